#!/usr/bin/env bash
# Both runs of llama-cpp-python's tests, then the comparison (compare.py): the counts with llama_cpp.Llama and
# with llamaspec.Llama, and every test whose outcome differs. Exit status 1 when llamaspec.Llama fails a test
# that llama_cpp.Llama passes. Extra arguments go to both pytest runs (e.g. -k cached).
# LCPTEST_DRAFT=self|prompt-lookup|MODEL also runs llamaspec.Llama with that draft model (a third report).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="${LCPTEST_WORK:-$HOME/.cache/llamaspec-lcp-tests}"
mkdir -p "$WORK/reports"
DRAFT="${LCPTEST_DRAFT:-}"
unset LCPTEST_DRAFT
LCPTEST_REPORT="$WORK/reports/llama_cpp.json" "$HERE/run.sh" llama_cpp -q "$@" >"$WORK/reports/llama_cpp.log" 2>&1
LCPTEST_REPORT="$WORK/reports/llamaspec.json" "$HERE/run.sh" llamaspec -q "$@" >"$WORK/reports/llamaspec.log" 2>&1
"${PYTHON:-python}" "$HERE/compare.py" "$WORK/reports/llama_cpp.json" "$WORK/reports/llamaspec.json"
rc=$?
if [ -n "$DRAFT" ]; then
    LCPTEST_DRAFT="$DRAFT" LCPTEST_REPORT="$WORK/reports/llamaspec-draft.json" "$HERE/run.sh" llamaspec -q "$@" \
        >"$WORK/reports/llamaspec-draft.log" 2>&1
    echo; echo "== with draft_model=$DRAFT"
    "${PYTHON:-python}" "$HERE/compare.py" "$WORK/reports/llama_cpp.json" "$WORK/reports/llamaspec-draft.json" \
        --labels llama_cpp.Llama "llamaspec+draft" || rc=1
fi
echo "(logs and reports in $WORK/reports)"
exit $rc
