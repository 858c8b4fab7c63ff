"""Structured outputs: what a request's constraint compiles to (spec), and the compiler
that makes and caches grammars off the engine's thread (compiler). The runner's matchers
and bitmasks are in runtime/grammar.py."""
from .compiler import Grammar, GrammarCompiler, GrammarError, GrammarStats
from .spec import GrammarSpec, grammar_spec

# A request whose grammar a client checked already (the server's lookup counted it): the
# engine's own lookup is not counted again.
_CHECKED = "_grammar_checked"


def mark_checked(so) -> None:
    object.__setattr__(so, _CHECKED, True)


def checked(so) -> bool:
    return getattr(so, _CHECKED, False)


__all__ = ["Grammar", "GrammarCompiler", "GrammarError", "GrammarSpec", "GrammarStats", "checked", "grammar_spec",
           "mark_checked"]
