#!/usr/bin/env bash
# GPU check (optional to run, required to exist): the data-plane and engine exactness tests
# with the gpu tier (and the model) on CUDA, host pools pinned, on both backends; the vLLM
# connector's CUDA transfer path (pinned staging, a side stream, events) with the engine-free
# protocol run on GPU tensors (tests/engines/test_vllm_transfer_gpu.py).
#
#   ci/gpu-check.sh            # without a usable CUDA GPU: the CPU part only
#
# The CPU part (every machine; .ci/run runs it): CudaCopier's logic -- save, load, close,
# both layouts -- on CPU tensors with stand-in streams and events
# (tests/engines/test_vllm_transfer_gpu.py -k logic_on_cpu).
#
# KVCM_ENGINE_DEVICE=cuda puts kvcm.engine's model and the data plane's gpu pools on the GPU;
# the no-cache reference runs on the same device.  Backends: KVCM_GPU_BACKENDS (default
# "python cpp").  Extra pytest arguments: KVCM_PYTEST_ARGS.
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

echo "== gpu-check: the CPU part (CudaCopier's logic on CPU tensors)"
"$PY" -m pytest tests/engines/test_vllm_transfer_gpu.py -k logic_on_cpu -p no:cacheprovider --tb=short -ra ${KVCM_PYTEST_ARGS:-} || {
  echo "gpu-check: FAILED (the CPU part)"; exit 1; }
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  echo "gpu-check: no CUDA GPU visible to torch (or torch is not installed): the CPU part only"
  exit 0
fi
"$PY" -c "import torch; print('gpu-check: torch', torch.__version__, 'on', torch.cuda.get_device_name(0))"

export KVCM_ENGINE_DEVICE=cuda
unset KVCM_ALLOW_NO_CPP KVCM_OPLOG
# shellcheck disable=SC2206
EXTRA=(${KVCM_PYTEST_ARGS:-})
rc=0
for backend in ${KVCM_GPU_BACKENDS:-python cpp}; do
  echo "== gpu-check: KVCM_BACKEND=$backend, KVCM_ENGINE_DEVICE=cuda"
  KVCM_BACKEND=$backend "$PY" -m pytest tests/engines/test_engine_exactness.py tests/dataplane/test_dataplane.py tests/engines/test_engine_faults.py \
    tests/fleet/test_shared_engine.py tests/engines/test_vllm_transfer_gpu.py \
    -p no:cacheprovider --tb=short -ra "${EXTRA[@]}" || rc=1
done
echo "== gpu-check: demo on cuda"
"$PY" -c "import sys; from kvcm.cli.demo import main; sys.exit(main(['--device', 'cuda']))" || rc=1
[ "$rc" -eq 0 ] && echo "gpu-check: ok" || echo "gpu-check: FAILED"
exit $rc
