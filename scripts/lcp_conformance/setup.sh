#!/usr/bin/env bash
# One-time setup: an unmodified copy of llama-cpp-python 0.3.36's tests (tests/ of its sdist) and the vocabulary
# GGUF they read (vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf), under $LCPTEST_WORK
# (default ~/.cache/llamaspec-lcp-tests). The sdist comes from $LCP_SDIST, else native/downloads/ of this
# checkout (scripts/build_llama_cpp.sh puts it there), else the work dir's own copy, else `pip download`
# (once). Also installs the tests' one requirement the project's dev extra lacks (scipy) into the active Python.
set -eu
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
WORK="${LCPTEST_WORK:-$HOME/.cache/llamaspec-lcp-tests}"
VER=0.3.36
PY="${PYTHON:-python}"
mkdir -p "$WORK/dl"
SDIST="${LCP_SDIST:-}"
for cand in "$SDIST" "$ROOT/native/downloads/llama_cpp_python-$VER.tar.gz" "$WORK/dl/llama_cpp_python-$VER.tar.gz"; do
    if [ -n "$cand" ] && [ -f "$cand" ]; then SDIST="$cand"; break; fi
done
if [ -z "$SDIST" ] || [ ! -f "$SDIST" ]; then
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$WORK/dl" "llama-cpp-python==$VER"
    SDIST="$WORK/dl/llama_cpp_python-$VER.tar.gz"
fi
SRC="$WORK/llama_cpp_python-$VER"
rm -rf "$SRC"
tar xzf "$SDIST" -C "$WORK" "llama_cpp_python-$VER/tests" \
    "llama_cpp_python-$VER/vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf"
"$PY" -c "import scipy" 2>/dev/null || "$PY" -m pip install -q "scipy>=1.10"
echo "tests copied to $SRC/tests (from $SDIST)"
