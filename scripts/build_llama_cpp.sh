#!/usr/bin/env bash
# Build the llama.cpp that llama-cpp-python 0.3.36 vendors (taken from that exact sdist on PyPI, so the
# native library and tools can never drift from the Python bindings). Run with --help for the options.
set -euo pipefail

LCP_VERSION="0.3.36"
SDIST_NAME="llama_cpp_python-${LCP_VERSION}.tar.gz"
# sha256 of the PyPI sdist (pip download verifies it against the index; checked again here).
SDIST_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

PROG="$(basename "$0")"

usage() {
    cat <<EOF
Usage: $PROG [OPTIONS]

Build llama.cpp exactly as vendored by llama-cpp-python ${LCP_VERSION}: the sdist is fetched from PyPI
(pip download) or given with --sdist, its vendor/llama.cpp tree is configured with cmake and built.
Re-running is cheap: nothing is downloaded, extracted or configured again unless something changed,
and the build itself is incremental.

Options:
  --prefix DIR        where everything goes (default: ./native):
                        DIR/downloads  the sdist tarball
                        DIR/src        the extracted llama.cpp tree
                        DIR/build      the cmake build tree
                        DIR/lib        shared libraries (libllama + libggml*), for LLAMA_CPP_LIB_PATH
                        DIR/bin        tools (llama-server, llama-speculative-simple, llama-cli, llama-bench;
                                       ggml-rpc-server with --rpc)
                        DIR/include    llama.h and the ggml headers
  --targets WHAT      lib    the shared library only (usable via LLAMA_CPP_LIB_PATH)
                      tools  llama-server, llama-speculative-simple, llama-cli, llama-bench (+ the library)
                      all    both (default)
  --blas              GGML_BLAS=ON (pick a vendor with --cmake-arg -DGGML_BLAS_VENDOR=OpenBLAS)
  --cuda              GGML_CUDA=ON (needs nvcc; e.g. --cmake-arg -DCMAKE_CUDA_ARCHITECTURES=native)
  --metal             GGML_METAL=ON (the default on macOS; --no-metal turns it off)
  --no-metal          GGML_METAL=OFF
  --rpc               GGML_RPC=ON: the RPC backend in the library (libggml-rpc, for llamaspec --rpc) and,
                      with --targets tools or all, the server ggml-rpc-server to run where the layers live
  --cmake-arg ARG     extra argument for the cmake configure step (repeatable), e.g. -DGGML_NATIVE=OFF
  --jobs N            parallel build jobs (default: number of CPUs)
  --sdist PATH        use this llama-cpp-python ${LCP_VERSION} sdist instead of downloading it: the
                      .tar.gz (its sha256 is checked) or an already extracted sdist directory
  -h, --help          show this help

Fixed settings: Release build, shared libraries, no tests, no web UI download, LLAMA_OPENSSL=OFF (the
tools are not meant to fetch models over HTTPS; LLAMA_CURL no longer exists in this llama.cpp), RPATH
\$ORIGIN so DIR/lib and DIR/bin work from anywhere. Any of these can be overridden with --cmake-arg.

Use the library from Python:
  export LLAMA_CPP_LIB_PATH=\$PWD/native/lib    # the directory holding libllama.so
EOF
}

die() { echo "$PROG: error: $*" >&2; exit 1; }
say() { echo "==> $*" >&2; }

# ---------------------------------------------------------------------------------------------------
# options (long options, "--opt VALUE" or "--opt=VALUE")

prefix="./native"
targets="all"
jobs=""
sdist=""
blas=OFF cuda=OFF rpc=OFF
metal=""
extra_args=()

need_value() { [[ $# -ge 2 && -n "$2" ]] || die "option $1 needs a value (see --help)"; }

while [[ $# -gt 0 ]]; do
    opt="$1"
    if [[ "$opt" == --*=* ]]; then
        set -- "${opt%%=*}" "${opt#*=}" "${@:2}"
        opt="$1"
    fi
    case "$opt" in
        -h|--help) usage; exit 0 ;;
        --prefix) need_value "$@"; prefix="$2"; shift 2 ;;
        --targets) need_value "$@"; targets="$2"; shift 2 ;;
        --jobs|-j) need_value "$@"; jobs="$2"; shift 2 ;;
        --sdist) need_value "$@"; sdist="$2"; shift 2 ;;
        --cmake-arg) need_value "$@"; extra_args+=("$2"); shift 2 ;;
        --blas) blas=ON; shift ;;
        --cuda) cuda=ON; shift ;;
        --metal) metal=ON; shift ;;
        --no-metal) metal=OFF; shift ;;
        --rpc) rpc=ON; shift ;;
        *) die "unknown option '$opt' (see --help)" ;;
    esac
done

case "$targets" in lib|tools|all) ;; *) die "--targets must be lib, tools or all (got '$targets')" ;; esac

ncpu() { nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 2; }
[[ -z "$jobs" ]] && jobs="$(ncpu)"
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || die "--jobs must be a positive integer (got '$jobs')"

os="$(uname -s)"
if [[ -z "$metal" ]]; then
    if [[ "$os" == Darwin ]]; then metal=ON; else metal=OFF; fi
fi

# ---------------------------------------------------------------------------------------------------
# prerequisites

command -v cmake >/dev/null 2>&1 || die "cmake not found: install cmake >= 3.14 (e.g. 'apt-get install cmake' or 'pip install cmake')"
cmake_ver="$(cmake --version | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')"
if [[ -n "$cmake_ver" ]]; then
    IFS=. read -r cm_major cm_minor _ <<<"$cmake_ver"
    if (( cm_major < 3 || (cm_major == 3 && cm_minor < 14) )); then
        die "cmake $cmake_ver is too old: llama.cpp needs >= 3.14"
    fi
fi
cxx="${CXX:-}"
if [[ -z "$cxx" ]]; then
    for c in c++ g++ clang++; do command -v "$c" >/dev/null 2>&1 && { cxx="$c"; break; }; done
fi
[[ -n "$cxx" ]] && command -v "$cxx" >/dev/null 2>&1 \
    || die "no C++ compiler found: install g++ or clang++ (e.g. 'apt-get install build-essential') or set CXX"
cc="${CC:-}"
if [[ -z "$cc" ]]; then
    for c in cc gcc clang; do command -v "$c" >/dev/null 2>&1 && { cc="$c"; break; }; done
fi
[[ -n "$cc" ]] && command -v "$cc" >/dev/null 2>&1 || die "no C compiler found: install gcc or clang, or set CC"
command -v tar >/dev/null 2>&1 || die "tar not found"
if [[ "$cuda" == ON ]] && ! command -v nvcc >/dev/null 2>&1 && [[ -z "${CUDACXX:-}" ]]; then
    die "--cuda given but nvcc is not on PATH: install the CUDA toolkit or set CUDACXX"
fi

sha256() {
    if command -v sha256sum >/dev/null 2>&1; then sha256sum "$1" | cut -d' ' -f1
    else shasum -a 256 "$1" | cut -d' ' -f1; fi
}

find_python() {
    for p in "${PYTHON:-}" python3 python; do
        [[ -n "$p" ]] && command -v "$p" >/dev/null 2>&1 && "$p" -m pip --version >/dev/null 2>&1 && { echo "$p"; return 0; }
    done
    return 1
}

mkdir -p "$prefix"
prefix="$(cd "$prefix" && pwd)"
downloads="$prefix/downloads"
srcdir="$prefix/src/llama.cpp"
builddir="$prefix/build"
start_time=$SECONDS

# ---------------------------------------------------------------------------------------------------
# 1. the sdist

src_id=""       # identifies the source the tree was extracted from (for the stamp)
sdist_tar=""
sdist_dir=""
if [[ -n "$sdist" ]]; then
    [[ -e "$sdist" ]] || die "--sdist: '$sdist' does not exist"
    if [[ -d "$sdist" ]]; then
        sdist_dir="$(cd "$sdist" && pwd)"
        [[ -f "$sdist_dir/PKG-INFO" ]] || die "--sdist: '$sdist' has no PKG-INFO: not an extracted sdist"
        grep -qx "Version: $LCP_VERSION" "$sdist_dir/PKG-INFO" \
            || die "--sdist: '$sdist' is not llama-cpp-python $LCP_VERSION ($(grep -m1 '^Version:' "$sdist_dir/PKG-INFO"))"
        [[ -f "$sdist_dir/vendor/llama.cpp/CMakeLists.txt" ]] || die "--sdist: '$sdist' has no vendor/llama.cpp"
        src_id="dir:$sdist_dir"
    else
        sdist_tar="$(cd "$(dirname "$sdist")" && pwd)/$(basename "$sdist")"
    fi
else
    sdist_tar="$downloads/$SDIST_NAME"
    if [[ ! -f "$sdist_tar" ]]; then
        py="$(find_python)" || die "need python with pip to download the sdist (or pass --sdist FILE)"
        say "downloading llama-cpp-python $LCP_VERSION sdist from PyPI into $downloads"
        mkdir -p "$downloads"
        "$py" -m pip download --no-deps --no-binary :all: --disable-pip-version-check \
            "llama-cpp-python==$LCP_VERSION" -d "$downloads" >&2 \
            || die "pip download of llama-cpp-python==$LCP_VERSION failed (offline? pass --sdist FILE with a copy of $SDIST_NAME)"
        [[ -f "$sdist_tar" ]] || die "pip download did not produce $sdist_tar"
    fi
fi
if [[ -n "$sdist_tar" ]]; then
    sum="$(sha256 "$sdist_tar")"
    [[ "$sum" == "$SDIST_SHA256" ]] \
        || die "$sdist_tar: sha256 $sum does not match the PyPI sdist of llama-cpp-python $LCP_VERSION ($SDIST_SHA256)"
    src_id="sha256:$sum"
fi

# ---------------------------------------------------------------------------------------------------
# 2. the llama.cpp tree (extracted once per source)

stamp="$prefix/src/.llama.cpp.source"
if [[ -f "$stamp" && -f "$srcdir/CMakeLists.txt" && "$(cat "$stamp")" == "$src_id" ]]; then
    say "source tree up to date: $srcdir"
else
    say "extracting vendor/llama.cpp into $srcdir"
    tmp="$prefix/src/.extract.$$"
    rm -rf "$tmp" && mkdir -p "$tmp"
    trap 'rm -rf "$tmp"' EXIT
    if [[ -n "$sdist_dir" ]]; then
        cp -a "$sdist_dir/vendor/llama.cpp/." "$tmp/"
    else
        tar -xzf "$sdist_tar" -C "$tmp" --strip-components=3 "llama_cpp_python-$LCP_VERSION/vendor/llama.cpp" \
            || die "could not extract vendor/llama.cpp from $sdist_tar"
    fi
    [[ -f "$tmp/CMakeLists.txt" ]] || die "extracted tree has no CMakeLists.txt"
    rm -rf "$srcdir"
    mv "$tmp" "$srcdir"
    trap - EXIT
    echo "$src_id" >"$stamp"
    rm -f "$builddir/.llamaspec-configure"  # new sources: configure again
fi

# ---------------------------------------------------------------------------------------------------
# 3. configure (only when the settings changed)

want_tools=OFF
[[ "$targets" != lib ]] && want_tools=ON

if [[ "$os" == Darwin ]]; then rpath='@loader_path;@loader_path/../lib'; else rpath='$ORIGIN;$ORIGIN/../lib'; fi

cmake_args=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=ON
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON
    "-DCMAKE_INSTALL_RPATH=$rpath"
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_COMMON="$want_tools"
    -DLLAMA_BUILD_TOOLS="$want_tools"
    -DLLAMA_BUILD_EXAMPLES="$want_tools"
    -DLLAMA_BUILD_SERVER="$want_tools"
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_OPENSSL=OFF
    -DGGML_BLAS="$blas"
    -DGGML_CUDA="$cuda"
    -DGGML_METAL="$metal"
    -DGGML_RPC="$rpc"
)
cmake_args+=("${extra_args[@]+"${extra_args[@]}"}")

generator=()
if [[ -f "$builddir/CMakeCache.txt" ]]; then
    :  # keep the generator the tree was created with
elif command -v ninja >/dev/null 2>&1; then
    generator=(-G Ninja)
fi

cfg_stamp="$builddir/.llamaspec-configure"
cfg_id="$(printf '%s\n' "$srcdir" "${cmake_args[@]}")"
if [[ -f "$builddir/CMakeCache.txt" && -f "$cfg_stamp" && "$(cat "$cfg_stamp")" == "$cfg_id" ]]; then
    say "cmake configuration up to date: $builddir"
else
    say "configuring: cmake -S $srcdir -B $builddir ${cmake_args[*]}"
    rm -f "$cfg_stamp"
    cmake -S "$srcdir" -B "$builddir" "${generator[@]+"${generator[@]}"}" "${cmake_args[@]}" >&2 \
        || die "cmake configure failed (see the output above; a missing backend SDK is the usual cause)"
    printf '%s' "$cfg_id" >"$cfg_stamp"
fi

# ---------------------------------------------------------------------------------------------------
# 4. build

lib_targets=(llama)
tool_targets=()
if [[ "$want_tools" == ON ]]; then
    tool_targets=(llama-server llama-speculative-simple llama-cli llama-bench)
    [[ "$rpc" == ON ]] && tool_targets+=(ggml-rpc-server)
fi
all_targets=("${lib_targets[@]}" "${tool_targets[@]+"${tool_targets[@]}"}")
say "building ${all_targets[*]} with $jobs job(s)"
cmake --build "$builddir" --config Release --parallel "$jobs" --target "${all_targets[@]}" >&2 \
    || die "build failed (see the output above)"

# ---------------------------------------------------------------------------------------------------
# 5. stage DIR/lib, DIR/bin, DIR/include

bindir_build="$builddir/bin"
mkdir -p "$prefix/lib" "$prefix/bin" "$prefix/include"
case "$os" in
    Darwin) libglob='lib*.dylib' ;;
    MINGW*|MSYS*|CYGWIN*) libglob='*.dll' ;;
    *) libglob='lib*.so*' ;;
esac
shopt -s nullglob
libs=("$bindir_build"/$libglob)
shopt -u nullglob
[[ ${#libs[@]} -gt 0 ]] || die "no shared libraries found in $bindir_build"
cp -a "${libs[@]}" "$prefix/lib/"
for t in "${tool_targets[@]+"${tool_targets[@]}"}"; do
    exe="$bindir_build/$t"
    [[ -f "$exe" ]] || exe="$bindir_build/$t.exe"
    [[ -f "$exe" ]] || die "tool $t was not built ($bindir_build)"
    cp -a "$exe" "$prefix/bin/"
done
cp -a "$srcdir/include/llama.h" "$srcdir/include/llama-cpp.h" "$srcdir"/ggml/include/*.h "$prefix/include/"

# ---------------------------------------------------------------------------------------------------
# 6. report

libllama="$(ls "$prefix/lib"/libllama.so "$prefix/lib"/libllama.dylib "$prefix/lib"/llama.dll 2>/dev/null | head -n1 || true)"
elapsed=$((SECONDS - start_time))
echo
echo "llama.cpp (llama-cpp-python $LCP_VERSION vendored tree) built in ${elapsed}s"
echo "  source:   $srcdir"
echo "  build:    $builddir"
echo "  library:  ${libllama:-$prefix/lib}"
echo "  libs:     $(cd "$prefix/lib" && ls | tr '\n' ' ')"
if [[ ${#tool_targets[@]} -gt 0 ]]; then
    for t in "${tool_targets[@]}"; do echo "  tool:     $prefix/bin/$t"; done
fi
echo "  backends: BLAS=$blas CUDA=$cuda Metal=$metal RPC=$rpc"
echo
echo "To use this library from llama-cpp-python / llamaspec:"
echo "  export LLAMA_CPP_LIB_PATH=$prefix/lib"
