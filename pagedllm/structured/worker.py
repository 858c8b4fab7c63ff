"""The grammar-compiling process: `python -m pagedllm.structured.worker`.

Compiling runs here, not in the engine's process, so that the one compile a hostile
schema or grammar makes slow can be killed at its deadline: a thread could only be
abandoned, and would go on burning a core the engine needs. Frames on stdin/stdout are
an 8-byte length and a pickle: first the tokenizer's xgrammar TokenizerInfo (serialized),
then (kind, text, any_whitespace) jobs, each answered ("ok", compiled grammar serialized,
seconds) or ("error", message). A grammar compiled within REBUILD_SECONDS is answered ("ok",
None, seconds): the engine compiles it again in its own process, cheaper than this JSON (the
form schema of benchmarks/structured_outputs.py: compiled in 8 ms, serialized in 31 ms to
0.58 MB, read back in 17 ms)."""
from __future__ import annotations

import sys
import time

from .compiling import compile_spec, error_message
from .frames import read_frame, write_frame

# A compile may use this much memory beyond what the process holds after its imports.
MEMORY_LIMIT = 4 << 30
# Compiles at most this long are not serialized: this run proved the spec compiles in time and
# in memory, and compiling it again in the engine's process (xgrammar releases the GIL) then
# costs less than the JSON's round trip. Longer ones cross as JSON: the engine never spends
# more than this on a tenant's grammar.
REBUILD_SECONDS = 0.1


def main() -> None:
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the frames
    import resource

    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(read_frame(inp))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    try:  # the address space after the imports, plus what one compile may take
        with open("/proc/self/statm") as f:
            held = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (held + MEMORY_LIMIT, held + MEMORY_LIMIT))
    except (OSError, ValueError):
        pass  # not Linux: the time limit still holds
    write_frame(out, ("ready",))
    while True:
        try:
            kind, text, ws = read_frame(inp)
        except EOFError:
            return
        t0 = time.perf_counter()
        try:
            compiled = compile_spec(compiler, kind, text, ws)
            seconds = time.perf_counter() - t0
            write_frame(out, ("ok", None if seconds <= REBUILD_SECONDS else compiled.serialize_json(), seconds))
        except MemoryError:
            write_frame(out, ("error", f"compiling needs more than {MEMORY_LIMIT >> 30} GiB of memory"))
        except Exception as e:  # a bad schema, regex or grammar: the message goes to the client
            write_frame(out, ("error", error_message(e)))


if __name__ == "__main__":
    main()
