#!/usr/bin/env bash
# Build a wheel from this checkout (`pip wheel .`), check that it carries every data file git tracks under
# llamaspec/ (models.toml, prompts...), install it into a fresh venv and run llamaspec.Llama there, outside the
# source tree: one short greedy completion on smollm2-135m-q4_1 (from the model cache; fetched if missing).
#
# usage: scripts/check_wheel.sh [WORKDIR]      (default: a new temporary folder, removed afterwards)
# llama-cpp-python is installed from a wheel pip has already built (pip's wheel cache, or $LCP_WHEEL) when one
# is there, so the check does not compile llama.cpp again; otherwise pip builds it (several minutes).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if [ $# -ge 1 ]; then WORK="$1"; mkdir -p "$WORK"; else WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT; fi
echo "== pip wheel $ROOT -> $WORK/dist"
"$PY" -m pip wheel -q "$ROOT" --no-deps -w "$WORK/dist"
WHEEL="$(ls "$WORK"/dist/llamaspec-*.whl)"
echo "   $(basename "$WHEEL")"

echo "== package data in the wheel"
"$PY" -m zipfile -l "$WHEEL" | awk 'NR > 1 {print $1}' >"$WORK/wheel-files.txt"
missing=0
while IFS= read -r f; do
    if ! grep -qxF "$f" "$WORK/wheel-files.txt"; then
        echo "   MISSING: $f"; missing=1
    fi
done < <(cd "$ROOT" && git ls-files llamaspec | grep -v '\.py$')
[ "$missing" = 0 ] || { echo "the wheel lacks tracked data files (pyproject [tool.setuptools.package-data])"; exit 1; }
if grep -Eq '^(tests|scripts)/' "$WORK/wheel-files.txt"; then
    echo "the wheel carries tests/ or scripts/"; exit 1
fi
echo "   ok: $(cd "$ROOT" && git ls-files llamaspec | grep -vc '\.py$') data files"

echo "== fresh venv"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
LCP="${LCP_WHEEL:-$(find "$HOME/.cache/pip/wheels" -name 'llama_cpp_python-0.3.36-*.whl' 2>/dev/null | head -1)}"
if [ -n "$LCP" ]; then
    echo "   llama-cpp-python from $LCP"
    "$VPY" -m pip install -q "$LCP"
fi
"$VPY" -m pip install -q "$WHEEL"

echo "== llamaspec.Llama from the installed wheel (cwd /tmp)"
cd /tmp
"$VPY" - <<'EOF'
import os
import subprocess
import sys

import llamaspec
from llamaspec import Llama

where = os.path.dirname(llamaspec.__file__)
assert where.startswith(sys.prefix), f"llamaspec imported from {where}, not from the venv {sys.prefix}"
from llamaspec.models import repo_models_toml

toml = repo_models_toml()
assert toml.is_file() and toml.is_relative_to(sys.prefix), toml
path = subprocess.run([os.path.join(sys.prefix, "bin", "llamaspec"), "models", "path", "smollm2-135m-q4_1"],
                      capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
llm = Llama(path, n_ctx=256, n_threads=2, verbose=False)
out = llm("The capital of France is", max_tokens=8, temperature=0)
text = out["choices"][0]["text"]
assert out["usage"]["completion_tokens"] > 0 and text.strip(), out
print(f"   llamaspec {getattr(llamaspec, '__version__', '?')} from {where}")
print(f"   models.toml: {toml}")
print(f"   completion: {text!r} ({out['usage']['completion_tokens']} tokens, finish={out['choices'][0]['finish_reason']})")
llm.close()
EOF
echo "== wheel check passed"
