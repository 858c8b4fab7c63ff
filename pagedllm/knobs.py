"""knob(): a dataclass field that says what values it accepts and how its command-line flag reads.

One declaration serves every reader: `validate` checks a config against it (EngineConfig,
ServerOptions), pagedllm.cli builds each flag from it, and the docs' CLI page is written from
that parser. A rule that relates two fields stays code in the config's own __post_init__."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Spec:
    """What one knob accepts. Checked in this order: None (when optional), normalize, parse,
    kind, choices, range; the value that comes out is the one the config keeps."""
    kind: type | None = None          # int, float or bool (an int passes as a float); None: any
    choices: tuple | None = None
    ge: float | None = None           # the range: >= ge, > gt, <= le
    gt: float | None = None
    le: float | None = None
    # Reads the flag's text and the Python API's value alike (sizes such as "2GiB", JSON, URLs).
    parse: Callable[[Any], Any] | None = None
    # The Python API's other spellings (aliases the flag does not offer) to the canonical name;
    # it raises for a name it does not know, so it stands in for the choices' check.
    normalize: Callable[[Any], Any] | None = None
    optional: bool = False            # None is accepted as it is: the knob's default is None

    def check(self, name: str, value: Any) -> Any:
        """`value` as the config keeps it; ValueError naming `name` and what it accepts."""
        if value is None and self.optional:
            return None
        if self.normalize is not None:
            return self.normalize(value)
        if self.parse is not None:
            value = self.parse(value)
        if not self._has_kind(value) or not self._in_range(value) or (
                self.choices is not None and value not in self.choices):
            raise ValueError(f"{name} must be {self.describe()}, got {value!r}")
        return value

    def describe(self) -> str:
        """What is accepted, in words: "an integer in [1, 1024]", "one of ('fcfs', 'lpm')"."""
        if self.choices is not None:
            return f"one of {self.choices}"
        noun = {int: "an integer", float: "a number", bool: "True or False"}.get(self.kind, "a value")
        return f"{noun}{self.range_text()}"

    def range_text(self) -> str:
        low = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else None
        if self.le is not None:
            return f" in {low or '(-inf'}, {self.le:g}]"
        return f" >= {self.ge:g}" if self.ge is not None else f" > {self.gt:g}" if self.gt is not None else ""

    def _has_kind(self, value: Any) -> bool:
        if self.kind is None:
            return True
        if isinstance(value, bool) or self.kind is bool:  # True is an int to Python, never a count here
            return isinstance(value, bool) and self.kind is bool
        return isinstance(value, (int, float) if self.kind is float else self.kind)

    def _in_range(self, value: Any) -> bool:
        return not ((self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
                    or (self.le is not None and value > self.le))


def knob(default: Any, help: str, *, type: Callable[[str], Any] | None = None, choices: Iterable | None = None,
         ge: float | None = None, gt: float | None = None, le: float | None = None,
         normalize: Callable[[Any], Any] | None = None, **flag: Any) -> Any:
    """A field with what it accepts (`type`: int or float, or a parser of text and value alike;
    choices; a range) and its flag: the help text and argparse options beyond name, default,
    type and choices (action, nargs, metavar; `aliases`, more option strings). The keys of a
    JSON-valued knob (SpeculativeConfig, KVEventsConfig) are knobs too, checked the same way,
    with no flag of their own."""
    kind = type if type in (int, float) else builtin_kind(default)
    spec = Spec(kind, tuple(choices) if choices is not None else None, ge, gt, le,
                parse=type if type is not None and type not in (int, float) else None,
                normalize=normalize, optional=default is None)
    return field(default=default, metadata={"help": help, "spec": spec, "flag": flag})


def builtin_kind(default: Any) -> type | None:
    """The kind a default implies: a bool is a switch, a number says int or float."""
    return type(default) if isinstance(default, (bool, int, float)) else None


def spec_of(f: dataclasses.Field) -> Spec | None:
    return f.metadata.get("spec")


def validate(config: Any, prefix: str = "") -> None:
    """Check every knob of a dataclass instance, keeping the parsed value (sizes to bytes,
    JSON to its config, aliases to the canonical name). Frozen dataclasses too. `prefix`:
    where a nested config sits, for its errors ("speculative_config: ")."""
    for f in dataclasses.fields(config):
        spec = spec_of(f)
        if spec is not None:
            object.__setattr__(config, f.name, spec.check(prefix + f.name, getattr(config, f.name)))
