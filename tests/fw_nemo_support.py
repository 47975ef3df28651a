"""NeMo-RL's real package for tests/test_fw_nemo_rl.py: unpacked from its offline tarball
(`NeMo-RL-*.tar.gz`, NVIDIA-NeMo/RL 7ea279a; found as slime_support finds slime's), imported with
the stubs named below. Missing: skip, or FAIL under PREFIX_REUSE_REQUIRE_FRAMEWORKS=1.

Stubs (modules imported at NeMo-RL's load that need a GPU or an inference engine, loggers, and
Megatron-Bridge; nothing of them runs in a training step here):
* `zmq` (vLLM weight-sync IPC), `pynvml` (NVIDIA management), `mlflow`, `swanlab`, `wandb`,
  `matplotlib` (loggers / plots); prometheus-client is installed (tools/frameworks-requirements.txt);
* `megatron.bridge` (Megatron-Bridge: model providers and the CP partition helper
  `get_packed_seq_cp_partition_indices`, used only with context parallelism; CP=1 here);
* `BatchedDataDict.to("cuda")` (NeMo-RL moves each microbatch to CUDA) keeps tensors on CPU;
* Transformer Engine's THD attention for NeMo-RL's packed dense forward: slime_support's
  `ThdCoreAttention` (causal SDPA per packed segment, padded bounds).
"""
from __future__ import annotations

import importlib.machinery
import sys
import types

import torch

from slime_support import ThdCoreAttention, missing, unpacked

STUBBED = ("zmq", "pynvml", "mlflow", "swanlab", "wandb", "matplotlib", "matplotlib.pyplot",
           "megatron.bridge", "megatron.bridge.models", "megatron.bridge.models.model_provider",
           "megatron.bridge.training", "megatron.bridge.training.config",
           "megatron.bridge.training.state", "megatron.bridge.training.utils",
           "megatron.bridge.training.utils.packed_seq_utils")


class _StubModule(types.ModuleType):
    """A named stub: any attribute is an inert class (type annotations, isinstance checks)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, value)
        return value


def import_nemo_rl():
    import megatron_patches
    from megatron_patches.megatron_lm.compat import enable_megatron_lm_cpu_support
    megatron_patches.enable_cpu_support()
    enable_megatron_lm_cpu_support()  # NeMo-RL calls megatron.training.utils (position ids)
    root = unpacked("NeMo-RL", "nemo_rl")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    for name in STUBBED:
        if name not in sys.modules:
            module = _StubModule(name)
            module.__path__ = []
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec callers
            sys.modules[name] = module
            parent, _, leaf = name.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], leaf, module)
    try:
        import nemo_rl.models.megatron.train as train
        import nemo_rl.models.megatron.data  # noqa: F401
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    except ModuleNotFoundError as error:
        missing(f"NeMo-RL imports {error.name!r}: run in .venv-frameworks (make test-frameworks)")
    assert str(root) in train.__file__
    real_to = BatchedDataDict.to
    if not getattr(real_to, "_cpu", False):
        def to(self, device, *a, **k):
            return real_to(self, "cpu" if str(device).startswith("cuda") and
                           not torch.cuda.is_available() else device, *a, **k)
        to._cpu = True
        BatchedDataDict.to = to
    return train


def no_timer():
    """Megatron's StragglerDetector, as NeMo-RL's worker holds one (not configured: a no-op)."""
    from megatron.core.utils import StragglerDetector
    return StragglerDetector()


class _PaddedThd(ThdCoreAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None and packed_seq_params.cu_seqlens_q_padded is not None:
            packed_seq_params = types.SimpleNamespace(
                qkv_format="thd", cu_seqlens_q=packed_seq_params.cu_seqlens_q_padded)
        return super().forward(query, key, value, attention_mask, attn_mask_type,
                               attention_bias, packed_seq_params)


class _EitherAttention(torch.nn.Module):
    """The local spec's attention for NeMo-RL's unpacked rows; THD stand-in for packed ones."""

    def __init__(self, local, scale):
        super().__init__()
        self.local, self.thd = local, _PaddedThd(scale)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None:
            return self.thd(query, key, value, attention_mask, attn_mask_type, attention_bias,
                            packed_seq_params)
        return self.local(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                          attention_bias=attention_bias, packed_seq_params=None)


def nemo_model(packed: bool):
    from framework_data import SMALL
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count
    gpt = build_model(TinyLlamaConfig(**SMALL))
    gpt.config.calculate_per_token_loss = False  # NeMo-RL's regime
    gpt.config.finalize_model_grads_func = scale_grads_by_token_count
    for layer in gpt.decoder.layers:
        attn = layer.self_attention
        attn.core_attention = _EitherAttention(attn.core_attention, gpt.config.kv_channels ** -0.5)
    return gpt


def policy_cfg(packing: bool, prefix_reuse: bool) -> dict:
    """The `policy` keys NeMo-RL's Megatron step reads (its YAML's layout)."""
    return {"sequence_packing": {"enabled": packing, "fuse_loss": False,
                                 "algorithm": "modified_first_fit_decreasing",
                                 "train_mb_tokens": 256, "logprob_mb_tokens": 256},
            "dynamic_batching": {"enabled": False},
            "logprob_chunk_size": None, "make_sequence_length_divisible_by": 1,
            "megatron_cfg": {"tensor_model_parallel_size": 1, "sequence_parallel": False,
                             "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
                             "prefix_reuse": prefix_reuse}}


def clipped_pg_cfg(*, token_level_loss: bool, sequence_level_importance_ratios: bool = False):
    """NeMo-RL's ClippedPGLossConfig (pydantic) as its GRPO YAML's `loss_fn` section sets it."""
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig
    return ClippedPGLossConfig(**{"reference_policy_kl_penalty": 0.05, "reference_policy_kl_type": "k3",
            "kl_input_clamp_value": 20.0, "kl_output_clamp_value": 10.0,
            "ratio_clip_min": 0.2, "ratio_clip_max": 0.28, "ratio_clip_c": None,
            "use_on_policy_kl_approximation": False, "use_importance_sampling_correction": False,
            "truncated_importance_sampling_ratio": None, "token_level_loss": token_level_loss,
            "disable_ppo_ratio": False,
            "sequence_level_importance_ratios": sequence_level_importance_ratios,
            "force_on_policy_ratio": False})


def sampling_params(spec):
    if spec is None:
        return None
    from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams
    temperature, top_k, top_p = spec
    return TrainingSamplingParams(top_k=top_k, top_p=top_p, temperature=temperature)


def assert_grads_close(dense: dict, other: dict, tol: float = 1e-5):
    assert dense.keys() == other.keys()
    for name, d in dense.items():
        o = other[name]
        assert torch.isfinite(d).all() and torch.isfinite(o).all(), name
        err = float((d - o).abs().max() / d.abs().max().clamp(min=1e-12))
        assert err <= tol, f"grad {name}: relative error {err:.2e}"
