"""One xgrammar compile of a grammar spec, and its error as a client reads it: what the
compiling process runs (worker.py), and what the engine runs again for a grammar the
worker compiled quickly (compiler.py)."""
from __future__ import annotations


# A JSON answer's whitespace between two tokens of its syntax: at most this many characters.
# Unbounded (xgrammar's default, and vLLM's), a small model under a schema can spend its whole
# max_tokens on newlines and be cut, invalid (2 of 16 short chat prompts did here); 20 is
# llama.cpp's JSON grammar's bound, room for any indentation a model writes.
MAX_JSON_WHITESPACE = 20


def compile_spec(compiler, kind: str, text: str, any_whitespace: bool):
    """The xgrammar compile of one job (the kinds of spec.GrammarSpec)."""
    ws = {"any_whitespace": any_whitespace, "max_whitespace_cnt": MAX_JSON_WHITESPACE if any_whitespace else None}
    if kind == "json":
        return compiler.compile_json_schema(text, **ws)
    if kind == "json_object":  # any object: strict mode would forbid its properties
        return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **ws)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "grammar":
        return compiler.compile_grammar(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


def error_message(e: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "] " in text and text.startswith("["):
        text = text.split("] ", 1)[1]
    if ".cc:" in text.split(": ", 1)[0]:
        text = text.split(": ", 1)[1]
    return text
