"""GRPO training on Megatron-LM with prefix reuse: Megatron's arguments, checkpoints and logs.

    torchrun --nproc-per-node 8 examples/megatron_lm/train_grpo.py \
        $(python -m megatron_patches.models.model_configs megatron-args qwen3-8b) \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
        --seq-length 12288 --max-position-embeddings 40960 \
        --train-iters 100 --lr 1e-6 --grpo-prompts-per-step 8 --grpo-group-size 16 \
        --calculate-per-token-loss --prefix-reuse \
        --hf-checkpoint /ckpt/Qwen3-8B --save /ckpt/run --load /ckpt/run --save-interval 10 \
        --tensorboard-dir /ckpt/run/tb

Runs under torchrun from one CPU process (gloo; the CPU layer turns itself on without CUDA) to
many GPU nodes (NCCL). Needs a Megatron-LM checkout (core_r0.19.0 or main of 2026-08-22) on
PYTHONPATH, patched with `python -m megatron_patches apply --root CHECKOUT`. Without
`--prefix-reuse` the same steps run as stock Megatron dense training. See README,
"Training with Megatron-LM".
"""

from megatron_patches.megatron_lm.main import main

if __name__ == "__main__":
    raise SystemExit(main())
