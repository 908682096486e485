#!/usr/bin/env bash
# Sanitizer leg (issue #3): build the extension with AddressSanitizer + UndefinedBehaviorSanitizer
# (KVCM_SANITIZE=ON: -fsanitize=address,undefined -fno-omit-frame-pointer
# -fno-sanitize-recover=undefined, plus the usual -Wall -Wextra -Werror) in its own build dir,
# and run the parity suite (every scenario on both backends + the lockstep differential) and
# the cpp unit/thread tests against it with the ASan runtime preloaded.  The sanitized module is
# loaded straight from build/asan (ci/asan_ext.py), so the installed extension is never replaced.
# Any sanitizer report fails the run: ASan halts on the first error, UBSan cannot recover, and
# the log is grepped for reports as well.
#
#   ci/sanitize.sh                        # differential: KVCM_DIFF_EXAMPLES (default 100 here)
#   KVCM_DIFF_EXAMPLES=300 ci/sanitize.sh
#
# Python's own allocations are not leak-clean, so leak detection is off (detect_leaks=0).
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD=${KVCM_ASAN_BUILD:-build/asan}
OUT=${KVCM_CI_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/kvcm-sanitize.XXXXXX")}
mkdir -p "$OUT"
unset KVCM_ALLOW_NO_CPP KVCM_OPLOG

echo "== build with KVCM_SANITIZE=ON ($BUILD)"
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  GEN=()
  command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
  cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DKVCM_SANITIZE=ON -DKVCM_WERROR=ON \
    -DPython_EXECUTABLE="$(command -v "$PY")" || exit 1
fi
cmake --build "$BUILD" -j "$(nproc)" || exit 1

# The ASan runtime must come first; libstdc++ is preloaded too, or ASan's __cxa_throw
# interceptor finds no real __cxa_throw (python itself does not link libstdc++) and aborts
# on the first C++ exception.
PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libstdc++.so)"
run() {
  LD_PRELOAD="$PRELOAD" \
  ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1 \
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  KVCM_EXT_DIR="$BUILD" PYTHONPATH="ci${PYTHONPATH:+:$PYTHONPATH}" \
  KVCM_DIFF_EXAMPLES=${KVCM_DIFF_EXAMPLES:-100} \
    "$PY" -m pytest -p asan_ext -p no:cacheprovider -q --tb=short "$@"
}

echo "== parity (LD_PRELOAD=$PRELOAD)"
run parity 2>&1 | tee "$OUT/sanitize-parity.log"
rc=${PIPESTATUS[0]}
echo "== cpp unit and thread tests"
KVCM_BACKEND=cpp run tests/cpp tests/core/test_threads.py 2>&1 | tee "$OUT/sanitize-tests.log"
rc2=${PIPESTATUS[0]}
[ "$rc2" -ne 0 ] && rc=$rc2
if grep -qE "ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer|AddressSanitizer: CHECK failed" \
     "$OUT"/sanitize-*.log; then
  echo "ci/sanitize.sh: sanitizer report found (see $OUT)" >&2
  rc=1
fi
echo "== ci/sanitize.sh: exit $rc (logs: $OUT)"
exit $rc
