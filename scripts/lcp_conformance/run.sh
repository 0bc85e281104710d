#!/usr/bin/env bash
# Run llama-cpp-python 0.3.36's tests (the unmodified copy setup.sh made) offline on local GGUFs.
# usage: run.sh llama_cpp|llamaspec [pytest args...]     e.g. run.sh llamaspec -k cached_prompt -v
# Run with the project's venv active (llamaspec and llama-cpp-python importable). LCPTEST_REPORT=FILE writes
# every outcome as JSON; LCPTEST_DRAFT gives every llamaspec.Llama a draft model (lcp_local_models.py).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="${LCPTEST_WORK:-$HOME/.cache/llamaspec-lcp-tests}"
SRC="$WORK/llama_cpp_python-0.3.36"
[ -d "$SRC/tests" ] || "$HERE/setup.sh" || exit 2
IMPL="${1:?usage: run.sh llama_cpp|llamaspec [pytest args...]}"; shift
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
cd "$SRC"     # the tests read ./vendor/llama.cpp/models/... relative to the working directory
exec "${PYTHON:-python}" -m pytest -p lcp_local_models -p no:cacheprovider --lcp-impl "$IMPL" -rfEs \
    --timeout "${LCPTEST_TIMEOUT:-600}" tests "$@"
