"""What a structured-outputs request asks the compiler for, checked before anything is
compiled: the kind, the text to compile, and the key the compiled grammar is cached by.

Plain Python (no grammar library here): the server runs these checks on its event loop
for every constrained request, and a bad request gets its 400 naming the problem. The
bounds keep a hostile request cheap to refuse; the compiler's time limit covers the rest.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..sampling_params import StructuredOutputsParams
from ..util import json_object

# Bounds on what is compiled, so no single request can make compiling take long.
MAX_SPEC_CHARS = 64 * 1024       # a schema's JSON text, a grammar, a regex, the choices together
MAX_SCHEMA_DEPTH = 64            # nesting of objects and arrays in a schema
MAX_ENUM_VALUES = 1024           # enum / choice alternatives, summed over a schema
MAX_REPEAT = 100_000             # maxLength, maxItems and the like (larger asks for a huge automaton)

# Keywords the compiler enforces; annotations only describe. Anything else that JSON Schema
# defines as a constraint is refused: a client asking for uniqueItems and getting duplicates
# would be misled.
UNSUPPORTED_KEYWORDS = {
    "uniqueItems": "unique array items", "contains": "contains", "minContains": "minContains",
    "maxContains": "maxContains", "not": "not", "if": "if/then/else", "then": "if/then/else",
    "else": "if/then/else", "dependentRequired": "dependentRequired", "dependentSchemas": "dependentSchemas",
    "dependencies": "dependencies", "unevaluatedItems": "unevaluatedItems", "contentEncoding": "contentEncoding",
    "contentMediaType": "contentMediaType", "contentSchema": "contentSchema", "$dynamicRef": "$dynamicRef",
    "$recursiveRef": "$recursiveRef",
}
SUPPORTED_FORMATS = {"email", "date", "time", "date-time", "duration", "uuid", "uri", "uri-reference", "ipv4", "ipv6",
                     "hostname"}
_COUNTS = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties")
# Where sub-schemas sit: a keyword holding one schema, a list, or a map of them.
_ONE = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One compile job. `kind`: json (a schema), json_object, regex or grammar (a choice
    becomes a grammar of its alternatives); `text` what the compiler reads."""
    kind: str
    text: str
    any_whitespace: bool = True
    field: str = ""   # the request's field it came from (a choice compiles as a grammar)

    @property
    def key(self) -> tuple[str, str, bool]:
        return self.kind, self.text, self.any_whitespace


def grammar_spec(so: StructuredOutputsParams) -> GrammarSpec:
    """The compile job for a request's structured outputs; ValueError naming what is wrong
    (an invalid or too large schema, an unsupported schema feature, a too large regex,
    grammar or choice list). Syntax errors of a regex or grammar come from the compiler."""
    ws = not so.disable_any_whitespace
    kind = so.kind
    if kind == "json":
        schema = _parse_schema(so.json)
        check_schema(schema)
        return GrammarSpec("json", json.dumps(schema, separators=(",", ":"), ensure_ascii=False), ws)
    if kind == "json_object":
        return GrammarSpec("json_object", "", ws)
    if kind == "choice":
        if len(so.choice) > MAX_ENUM_VALUES:
            raise ValueError(f"structured_outputs.choice: {len(so.choice)} choices, at most {MAX_ENUM_VALUES}")
        # A grammar of string literals: no escaping rules of a regex dialect to get wrong.
        text = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice)
        _check_size("choice", text)
        return GrammarSpec("grammar", text, field="choice")
    text = getattr(so, kind)
    _check_size(kind, text)
    return GrammarSpec(kind, text)


def _check_size(field: str, text: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"structured_outputs.{field} is {len(text)} characters, at most {MAX_SPEC_CHARS}")


def _parse_schema(value: dict | str) -> dict:
    if isinstance(value, str):
        _check_size("json", value)
    value = json_object(value, "structured_outputs.json")
    _check_size("json", json.dumps(value))
    return value


def check_schema(schema: dict) -> None:
    """A schema we can enforce: valid under its metaschema (jsonschema's check), within the
    bounds, and using only keywords the compiler enforces."""
    import jsonschema  # light, but only constrained requests need it

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise ValueError(f"invalid JSON schema at #/{where}: {e.message}") from None
    except jsonschema.exceptions.UnknownType as e:  # pragma: no cover (check_schema raises SchemaError)
        raise ValueError(f"invalid JSON schema: {e}") from None
    enums = [0]
    _walk(schema, "#", 0, enums)


def _walk(node: Any, path: str, depth: int, enums: list[int]) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        return  # the metaschema check has refused what is not a schema
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels at {path}")
    for key, what in UNSUPPORTED_KEYWORDS.items():
        if key in node:
            raise ValueError(f"unsupported JSON-schema feature {key!r} ({what}) at {path}: structured outputs "
                             "cannot enforce it")
    fmt = node.get("format")
    if fmt is not None and fmt not in SUPPORTED_FORMATS:
        raise ValueError(f"unsupported JSON-schema string format {fmt!r} at {path}; supported: "
                         f"{', '.join(sorted(SUPPORTED_FORMATS))}")
    shaped = [k for k in ("format", "pattern") if k in node]
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    if shaped and lengths or len(shaped) > 1:  # the compiler would keep only the format (or the pattern)
        both = shaped + lengths
        raise ValueError(f"unsupported JSON-schema combination {' + '.join(both)} at {path}: structured outputs "
                         f"enforce one of format, pattern or a length range per string (put the length in the "
                         "pattern)")
    if len(node.get("allOf", ())) > 1:
        raise ValueError(f"unsupported JSON-schema feature 'allOf' with {len(node['allOf'])} schemas at {path}: "
                         "structured outputs enforce allOf of one schema only")
    for key in _COUNTS:
        if isinstance(node.get(key), int) and node[key] > MAX_REPEAT:
            raise ValueError(f"JSON schema {key} {node[key]} at {path} is more than {MAX_REPEAT}")
    if isinstance(node.get("enum"), list):
        enums[0] += len(node["enum"])
        if enums[0] > MAX_ENUM_VALUES:
            raise ValueError(f"JSON schema has more than {MAX_ENUM_VALUES} enum values (at {path})")
    for key in _ONE:
        sub = node.get(key)
        for i, one in enumerate(sub) if isinstance(sub, list) else [(None, sub)] if sub is not None else []:
            _walk(one, f"{path}/{key}" + ("" if i is None else f"/{i}"), depth + 1, enums)
    for key in _LIST:
        for i, sub in enumerate(node.get(key) or ()):
            _walk(sub, f"{path}/{key}/{i}", depth + 1, enums)
    for key in _MAP:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _walk(sub, f"{path}/{key}/{name}", depth + 1, enums)
