#!/usr/bin/env bash
# One machine, NPROC processes (GPUs, or gloo processes on a CPU-only machine):
#   NPROC=8 scripts/launch_local.sh configs/qwen35_vl_9b.yaml [key=value ...] [--dry-run]
#   NPROC=2 scripts/launch_local.sh configs/qwen35_vl_proxy.yaml parallel.cp=2
# NPROC defaults to the number of visible GPUs (1 without any).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:?usage: NPROC=N scripts/launch_local.sh CONFIG [key=value ...]}
shift
PYTHON=${PYTHON:-.venv/bin/python}
if [[ -z "${NPROC:-}" ]]; then
    NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [[ "$NPROC" -ge 1 ]] || NPROC=1
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    pretrain_multimodal.py --config "$CONFIG" "$@"
