"""The Megatron-LM training entry point (needs a Megatron-LM checkout: megatron.training).

compat (Python 3.11 / no-CUDA shims, opt-in), arguments (our `extra_args_provider`), data (RL step
sources: trace readers, synthetic generator), trace_source (the project's trace format as a
reader), quiet (the console without Megatron's argument dump and known-harmless warnings), model (model provider: Megatron-LM's gpt_builder),
trainer (the RL loop on megatron.training), checkpoints_hook (Hugging Face import/export), main;
rl_cpu and rl_replay (Megatron-LM's own train_rl.py on CPU, rollouts replayed from a trace:
examples/megatron_lm/train_rl_prefix_reuse.py).
Importing this package imports nothing from Megatron.
"""
