"""Arrows run one way: every module of pagedllm/ imports only from its own layer or the
layers below it, and no two modules or packages import each other.

Read statically with `ast`, so function-local imports count as much as module-level
ones: a deferred import still ties the two packages together."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pagedllm"

# Low to high. A name is a subpackage or a top-level module of pagedllm ("pagedllm" is the
# package's own __init__). Packages of one layer may import each other, but never in a circle.
LAYERS: list[tuple[str, ...]] = [
    ("pagedllm", "util", "knobs", "kv_dtype", "config", "plan", "sampling_params", "outputs", "pooling"),  # leaf data
    ("kv", "structured"),                              # the memory manager; grammar specs and compiling: no torch
    ("kernels", "distributed", "attention", "models"),  # compute: ops, collectives, the model
    ("loader", "lora"),                                # files -> weights, configs, tokenizers, adapters
    ("runtime",),                                      # the model runner and its TP ranks
    ("engine",),
    ("dp",),
    ("server",),
    ("deploy",),                                       # the server's app over many machines (Ray Serve)
    ("viz", "bench", "analysis", "cli", "demo", "preflight", "__main__", "ray_app", "env_report"),  # what users run
]

# Arrows up that are meant: (importing module, imported module), each with its reason.
FACADE = {
    # `pagedllm.LLM`, vLLM's top-level name: loaded by the package's __getattr__ on first use,
    # so that `import pagedllm.kv` stays light.
    ("pagedllm", "pagedllm.engine"),
}

# Known knots, pending a redraw: delete an entry when its import goes (none are left).
PENDING: set[tuple[str, str]] = set()

# Inside server/: its rooms by API, and which others each may import ("plumbing" is the shared
# modules flat in server/). Chat completions are the base the other APIs are served as: the
# Responses and Messages rooms make their requests chat's and go through the plumbing
# (prepare, streaming, translation), which uses openai's protocol pieces; neither room needs
# the other. Parsers read a model's text and know no API.
SERVER_ROOMS: dict[str, set[str]] = {
    "parsers": set(),
    "openai": {"parsers", "plumbing"},   # pooling's handlers queue through the plumbing
    "responses": {"openai", "plumbing"},
    "anthropic": {"openai", "plumbing"},
    "plumbing": {"parsers", "openai"},
}
# What puts every room together into one app: these may import any room.
SERVER_APP = {"pagedllm.server.api", "pagedllm.server.launch"}
# Arrows of the plumbing into an API room that are meant, each with its reason.
SERVER_MEANT = {
    # ServerState holds each tenant's stored responses, as it holds the served adapters.
    ("pagedllm.server.state", "pagedllm.server.responses.store"),
}

TORCH_FREE = ("kv",)  # with everything they import from pagedllm
# Modules of a unit that are torch-free by themselves (with what they import), though their unit is not.
REGISTRY = ("pagedllm.models.config", "pagedllm.models.registry", "pagedllm.models.family", "pagedllm.models.families")
HEAVY = ("torch", "triton", "numpy")


@dataclass(frozen=True)
class Import:
    source: str   # the importing module, dotted
    target: str   # the imported module (for `from pkg import mod`, pkg.mod), dotted
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path.relative_to(PACKAGE.parent)}:{self.line}"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(tree: ast.AST, module: str, is_package: bool, known: set[str], path: Path = PACKAGE) -> list[Import]:
    """Every import in `tree`, at any depth; relative ones resolved against `module`.
    Names outside pagedllm are kept too (torch, numpy), for the torch-free check."""
    here = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[:len(here.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import mod` imports the module pkg.mod; `from pkg import name`, pkg itself.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found += [Import(module, t, path, node.lineno) for t in dict.fromkeys(targets)]
    return found


def all_imports() -> list[Import]:
    mods = modules()
    found = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        found += imports_of(tree, name, path.name == "__init__.py", set(mods), path)
    return found


def unit(module: str) -> str:
    """The layer table's name for a pagedllm module: pagedllm.kv.manager -> kv."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


TIER = {name: i for i, names in enumerate(LAYERS) for name in names}


def internal(imports: list[Import]) -> list[Import]:
    return [i for i in imports if i.target == "pagedllm" or i.target.startswith("pagedllm.")]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    missing = sorted({unit(m) for m in modules()} - TIER.keys())
    assert not missing, f"place these in LAYERS (tests/test_layering.py): {missing}"


def test_no_import_from_a_higher_layer():
    wrong = [f"{i.where()}: {unit(i.source)} -> {unit(i.target)} ({i.target}, a higher layer)"
             for i in internal(all_imports())
             if TIER[unit(i.target)] > TIER[unit(i.source)] and (i.source, i.target) not in FACADE]
    assert not wrong, "arrows that run up:\n" + "\n".join(wrong)


def test_no_circle_of_imports():
    """Between packages of one layer, and between modules of one package. An import of a
    package's own __init__ (its parent) is how Python loads a submodule, not a circle."""
    imports = [i for i in internal(all_imports()) if (i.source, i.target) not in PENDING | FACADE]
    packages: dict[str, set[str]] = {}
    mods: dict[str, set[str]] = {}
    for i in imports:
        if unit(i.source) != unit(i.target):
            packages.setdefault(unit(i.source), set()).add(unit(i.target))
        if not i.source.startswith(i.target + ".") and i.source != i.target:
            mods.setdefault(i.source, set()).add(i.target)
    assert not cycles(packages), f"packages that import each other: {cycles(packages)}"
    found = cycles(mods)
    where = [i.where() + f": {i.source} -> {i.target}" for i in imports
             if any(i.source in c and i.target in c for c in found)]
    assert not found, "modules that import each other:\n" + "\n".join(where)


def test_pending_knots_are_still_there():
    """An entry of PENDING whose import is gone is deleted, so the list never hides a new knot."""
    edges = {(i.source, i.target) for i in internal(all_imports())}
    assert not PENDING - edges, f"delete from PENDING: {sorted(PENDING - edges)}"


def server_room(module: str) -> str | None:
    """The room of a module of server/: pagedllm.server.openai.protocol -> openai; a module
    flat in server/ -> plumbing; None outside server/."""
    parts = module.split(".")
    if parts[:2] != ["pagedllm", "server"]:
        return None
    return parts[2] if len(parts) > 2 and parts[2] in SERVER_ROOMS else "plumbing"


def test_every_server_room_is_declared():
    packages = {p.parent.name for p in (PACKAGE / "server").glob("*/__init__.py")}
    assert packages == SERVER_ROOMS.keys() - {"plumbing"}, "declare each room of server/ in SERVER_ROOMS"


def test_server_rooms_import_only_what_their_rule_allows():
    wrong = []
    for i in internal(all_imports()):
        src, dst = server_room(i.source), server_room(i.target)
        if src is None or dst is None or src == dst or i.source in SERVER_APP or (i.source, i.target) in SERVER_MEANT:
            continue
        if dst not in SERVER_ROOMS[src]:
            wrong.append(f"{i.where()}: {src} -> {dst} ({i.target})")
    assert not wrong, "imports between server/'s rooms that SERVER_ROOMS does not allow:\n" + "\n".join(wrong)


def test_server_meant_arrows_are_still_there():
    edges = {(i.source, i.target) for i in internal(all_imports())}
    assert not SERVER_MEANT - edges, f"delete from SERVER_MEANT: {sorted(SERVER_MEANT - edges)}"


def _assert_no_torch(todo: list[str]) -> None:
    """None of `todo` imports torch (or numpy, triton), nor does anything of pagedllm they import."""
    by_source: dict[str, list[Import]] = {}
    for i in all_imports():
        by_source.setdefault(i.source, []).append(i)
    seen = set(todo)
    while todo:
        for i in by_source.get(todo.pop(), []):
            assert i.target.split(".")[0] not in HEAVY, f"{i.where()}: {i.source} imports {i.target}"
            if i.target.startswith("pagedllm.") and i.target not in seen and i.target in modules():
                seen.add(i.target)
                todo.append(i.target)


def test_kv_imports_no_torch():
    _assert_no_torch([m for m in modules() if unit(m) in TORCH_FREE])


def test_the_model_registry_and_config_import_no_torch():
    """A config is read, and its family found, before any model is built (kv-calc, the server's
    front): the registry and the families' rows are plain data, and name their decoders."""
    _assert_no_torch([m for m in modules() if m.startswith(REGISTRY)])


def test_the_core_sits_below_loader_engine_server_and_viz():
    """The table itself keeps the rule of the issue: nothing in kernels/, kv/, attention/ or
    models/ imports loader/, engine/, server/ or viz/."""
    for low in ("kernels", "kv", "attention", "models"):
        for high in ("loader", "engine", "server", "viz"):
            assert TIER[low] < TIER[high], (low, high)


def test_imports_are_found_at_any_depth_and_resolved():
    """The reader itself: a function-local relative import counts, `from pkg import mod`
    names the module, `from pkg import name` the package."""
    src = ("import torch\n"
           "from ..loader import model_files, resolve_model_dir\n"
           "def f():\n"
           "    from ..engine.engine import LLMEngine\n"
           "    from . import rope\n")
    known = {"pagedllm.loader", "pagedllm.loader.model_files", "pagedllm.models.rope"}
    got = [(i.target, i.line) for i in imports_of(ast.parse(src), "pagedllm.models.llama", False, known)]
    assert got == [("torch", 1), ("pagedllm.loader.model_files", 2), ("pagedllm.loader", 2),
                   ("pagedllm.engine.engine", 4), ("pagedllm.models.rope", 5)]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
