#!/usr/bin/env bash
# Plain and default speculation under load on a GPU, against llama-server built from the same tree, in one run
# of under ten minutes (issue 24): builds the vendored llama.cpp of llama-cpp-python 0.3.36 with CUDA (library
# and tools), points llama-cpp-python at that library (LLAMA_CPP_LIB_PATH), and runs
#   llamaspec bench --server -ngl all at 1 and 8 clients on -np 8:
#   llamaspec plain and defaults against llama-server plain and draft-simple n_max 3 and 8.
#
#   scripts/gpu_bench.sh [--sdist PATH] [--target GGUF] [--draft GGUF] [--out DIR] [--dry-run]
#
# The machine needs nvcc, cmake and a C++ compiler, and this project installed in the active Python (pip
# install -e .[server]). Offline machines: give --sdist (pip download llama-cpp-python==0.3.36 --no-deps
# --no-binary :all:) and the models as paths. Defaults: the registry's Gemma-3-270M pair (llamaspec models
# path), output under ./gpu-bench. --dry-run prints the commands and checks the inputs without building.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
sdist="" target="" draft="" out="$here/gpu-bench" dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --sdist) sdist="$2"; shift 2 ;;
    --target) target="$2"; shift 2 ;;
    --draft) draft="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "gpu_bench.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

command -v llamaspec >/dev/null || { echo "gpu_bench.sh: llamaspec is not installed in this Python (pip install -e '.[server]')" >&2; exit 2; }
[ -n "$target" ] || target="$(llamaspec models path gemma3-270m-f32)"
[ -n "$draft" ] || draft="$(llamaspec models path gemma3-270m-q4km)"
for f in "$target" "$draft"; do
  [ -f "$f" ] || { echo "gpu_bench.sh: model file not found: $f" >&2; exit 2; }
done
if [ "$dry" = 0 ]; then
  command -v nvcc >/dev/null || { echo "gpu_bench.sh: nvcc not found: install the CUDA toolkit (or run with --dry-run)" >&2; exit 2; }
fi

build=("$here/scripts/build_llama_cpp.sh" --prefix "$out/native" --targets all --cuda
       --cmake-arg -DCMAKE_CUDA_ARCHITECTURES=native)
[ -n "$sdist" ] && build+=(--sdist "$sdist")
bench=(llamaspec bench --server -m "$target" -md "$draft" -ngl all --clients 1,8 -np 8 -c 8192 -n 128 --repeats 2
       --server-variants ls:plain,ls:defaults,native:plain,native:draft:3,native:draft:8
       --native-dir "$out/native" --json "$out/gpu-server.json" --markdown "$out/gpu-server.md")

echo "build: ${build[*]}"
echo "bench: LLAMA_CPP_LIB_PATH=$out/native/lib ${bench[*]}"
[ "$dry" = 1 ] && exit 0

mkdir -p "$out"
t0=$(date +%s)
"${build[@]}"
echo "built in $(( $(date +%s) - t0 )) s"
LLAMA_CPP_LIB_PATH="$out/native/lib" "${bench[@]}"
echo "done in $(( $(date +%s) - t0 )) s: $out/gpu-server.md"
