#!/usr/bin/env bash
# Multi-node GRPO training with prefix reuse: run this script once on EVERY node (same arguments).
#
#   NNODES=4 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0:29500 MEGATRON_LM=/path/to/Megatron-LM \
#     examples/megatron_lm/torchrun_multinode.sh $(python -m megatron_patches.model_configs \
#       megatron-args qwen3-8b) --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
#       --seq-length 12288 ... --prefix-reuse --save /ckpt/run --load /ckpt/run
#
# The agents meet through torchrun's c10d rendezvous at RDZV_ENDPOINT (host:port of any one
# node; it hosts the store); node ranks are assigned at the rendezvous. Everything after the
# script name goes to examples/megatron_lm/train_grpo.py (Megatron-LM's arguments + ours).
# PYTHON: the interpreter to run torchrun with (default: the `python` on PATH; give the venv's).
#
# On one machine without GPUs (CPU, gloo; add --clip-grad 0): one "node" of 2 processes
#   NNODES=1 NPROC_PER_NODE=2 RDZV_ENDPOINT=127.0.0.1:29500 MEGATRON_LM=$PWD/Megatron-LM \
#     examples/megatron_lm/torchrun_multinode.sh ... --clip-grad 0
# or two "nodes" on localhost: the same command with NNODES=2 NPROC_PER_NODE=1, run in two shells
# (both with the same RDZV_ENDPOINT and RDZV_ID).
set -euo pipefail

: "${NNODES:?set NNODES (number of nodes)}"
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port (any one node)}"
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
# the run's id: the same on every node (containers and SLURM batch steps may not set $USER)
RDZV_ID=${RDZV_ID:-prefix-reuse-${SLURM_JOB_ID:-${USER:-uid$(id -u)}}}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)

# Megatron-LM (a checkout patched with `python -m megatron_patches apply --root $MEGATRON_LM`)
# and this package on the path.
export PYTHONPATH="${MEGATRON_LM:+$MEGATRON_LM:}$REPO${PYTHONPATH:+:$PYTHONPATH}"
# Tensor parallelism on Hopper and older needs one CUDA work queue (Megatron checks it).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# A collective or p2p waiting longer than this for a peer fails the job (every process group,
# Megatron's too); torchrun then stops the other ranks.
export PREFIX_REUSE_COLLECTIVE_TIMEOUT_S=${PREFIX_REUSE_COLLECTIVE_TIMEOUT_S:-600}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

exec "${PYTHON:-python}" -m torch.distributed.run \
    --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" \
    ${MAX_RESTARTS:+--max-restarts "$MAX_RESTARTS"} \
    "$REPO/examples/megatron_lm/train_grpo.py" "$@"
