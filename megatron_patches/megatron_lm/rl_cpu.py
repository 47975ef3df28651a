"""CPU mode of examples/megatron_lm/train_rl_prefix_reuse.py: Megatron-LM's `train_rl.py` on a
machine without CUDA, its rollouts replayed from a trace (rl_replay.py).

`enable_cpu_mode()` runs only without CUDA (the launcher calls it then, before train_rl.py is
imported) and announces each stand-in on the console. None of them changes the math; each
replaces something that needs CUDA or is absent:
* CUDA-only arguments -> their CPU equivalents (`megatron_lm.main.CPU_ARGUMENT_CHANGES`, as
  examples/megatron_lm/train_grpo.py does: gloo, `--transformer-impl local`, no fused kernels,
  no RoPE fusion), applied after Megatron parses the command line and before it validates it;
* `initialize_megatron(allow_no_cuda=True)`; megatron/rl's `device="cuda"` factories create CPU
  tensors (`compat.see_cpu_torch`); `Tensor.cpu()` copies (`cpu_copies`);
* the inference interface (`rl_utils.get_inference_interface`, Megatron's CUDA engine and
  server) -> `rl_replay.replay_inference()`, engine-less;
* `NullTokenizer.bos_id = None`: prepare_trajectories asks the tokenizer for `bos`, which
  Megatron's text tokenizer reads from `bos_id`, which NullTokenizer (the file-less tokenizer of
  tiny runs) does not define (an AttributeError): no BOS;
* `GPTModel.forward` with train_rl's THD `PackedSeqParams` -> `cpu_thd_forward`: Transformer
  Engine's THD attention semantics without TE (the local attention refuses packed input);
* the `wandb` module when not installed (megatron/rl imports it for one type annotation) and
  `hybrid_builders` when absent (train_rl.py imports it; the 2026-08-22 snapshot lacks it; used
  only for hybrid models): `stub_missing_modules`.
Not run on CPU: rollout generation, CUDA graphs, Transformer Engine, bf16.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import torch

__all__ = ["enable_cpu_mode", "stub_missing_modules", "cpu_thd_forward", "cpu_copies",
           "cpu_arguments"]


_ENABLED = False


def _say(message: str) -> None:
    import os

    if os.environ.get("RANK", "0") == "0":
        print(f"> CPU mode: {message}", flush=True)


def stub_missing_modules() -> list:
    """`wandb` / `hybrid_builders` when absent (module doc); the names stubbed."""
    stubbed = []
    if "wandb" not in sys.modules and importlib.util.find_spec("wandb") is None:
        wandb = types.ModuleType("wandb")
        wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # find_spec callers
        wandb.wandb_run = types.SimpleNamespace(Run=object)
        sys.modules["wandb"] = wandb
        stubbed.append("wandb")
    if "hybrid_builders" not in sys.modules and importlib.util.find_spec("hybrid_builders") is None:
        hybrid = types.ModuleType("hybrid_builders")
        hybrid.__spec__ = importlib.machinery.ModuleSpec("hybrid_builders", None)

        def hybrid_builder(*_a, **_k):
            raise RuntimeError("hybrid_builders is not in this Megatron-LM snapshot")
        hybrid.hybrid_builder = hybrid_builder
        sys.modules["hybrid_builders"] = hybrid
        stubbed.append("hybrid_builders")
    return stubbed


def cpu_thd_forward(forward):
    """GPTModel.forward as train_rl calls it, a THD row run per sequence. train_rl always hands
    the model a THD `PackedSeqParams`, which Transformer Engine's attention reads and the local
    (CPU) attention refuses. This has TE's THD semantics without TE: the row [1, T] is cut at
    `cu_seqlens_q` (repeated entries are TE's zero-length ghost sequences) and each sequence
    runs through the stock forward alone, outputs concatenated: causal attention within the
    sequence only, RoPE positions from 0 at each sequence start (TE applies RoPE per cu_seqlens
    sequence), every other layer per token. Without packing that is ONE sequence spanning the
    row; with `--rl-use-sequence-packing` a bin's sequences and its padding tail. Anything else
    (padded cu_seqlens, batch > 1, cu_seqlens_kv != cu_seqlens_q) raises. It also drops
    get_logprobs' `fp32_output=True` (HybridModel's argument; the snapshot's GPTModel has none;
    fp32 models only). What the adapter passes (no PackedSeqParams) goes through unchanged."""
    def thd_forward(self, input_ids, position_ids, attention_mask, *args,
                    packed_seq_params=None, **kwargs):
        if kwargs.pop("fp32_output", True) is not True:
            raise RuntimeError("only fp32 models run here")
        if packed_seq_params is None:
            return forward(self, input_ids, position_ids, attention_mask, *args, **kwargs)
        p = packed_seq_params
        cu = p.cu_seqlens_q.tolist()
        if (input_ids.shape[0] != 1 or cu[0] != 0 or cu[-1] != input_ids.shape[1]
                or p.cu_seqlens_kv.tolist() != cu or p.cu_seqlens_q_padded is not None):
            raise RuntimeError(f"THD stand-in: one unpadded row cut at cu_seqlens, got {cu}")
        bounds = sorted(set(cu))
        return torch.cat([forward(self, input_ids[:, a:b], position_ids[:, a:b],
                                  attention_mask, *args, **kwargs)
                          for a, b in zip(bounds, bounds[1:])], dim=1)
    return thd_forward


def cpu_copies() -> None:
    """`Tensor.cpu()` returns a copy, as it does from a GPU. train_rl's loop keeps weights with
    `{k: v.cpu() for k, v in model.state_dict().items()}`: the reference policy (train()) and
    the current weights while the reference log-probs are computed (prepare_data_for_update
    loads the reference, then this dict back). On a CPU tensor `.cpu()` is the tensor itself, so
    both dicts would alias the live weights: the reference would follow training and, after the
    first reference pass, training would go on from the reference."""
    stock = torch.Tensor.cpu

    def cpu(self, *args, **kwargs):
        out = stock(self, *args, **kwargs)
        return out.clone() if out.data_ptr() == self.data_ptr() and out.numel() else out
    torch.Tensor.cpu = cpu


def cpu_arguments() -> None:
    """CPU_ARGUMENT_CHANGES applied to what Megatron's `parse_args` returns (train_rl.py calls
    `parse_and_validate_args`, which validates after it), each change announced on rank 0."""
    from megatron.training import arguments

    from megatron_patches.megatron_lm.main import CPU_ARGUMENT_CHANGES

    parse = arguments.parse_args

    def parse_args(*args, **kwargs):
        parsed = parse(*args, **kwargs)
        for name, value in CPU_ARGUMENT_CHANGES.items():
            if getattr(parsed, name) != value:
                _say(f"{name} {getattr(parsed, name)!r} -> {value!r} (needs CUDA)")
                setattr(parsed, name, value)
        return parsed
    arguments.parse_args = parse_args


def _allow_no_cuda() -> None:
    from megatron.training import training

    from megatron_patches.megatron_lm import compat

    compat.see_cpu_torch("megatron.rl.rl_utils", "megatron.rl.sequence_packing_utils")
    initialize = training.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        return initialize(*args, **{**kwargs, "allow_no_cuda": True})
    training.initialize_megatron = initialize_megatron


def enable_cpu_mode() -> None:
    """Every stand-in of the module doc, announced, with megatron.training's CPU support
    (`compat.enable_megatron_lm_cpu_support`); call before anything imports megatron.training
    (its training.py imports megatron.rl only if `wandb` imports). Idempotent."""
    global _ENABLED
    if torch.cuda.is_available():
        raise RuntimeError("enable_cpu_mode is for machines without CUDA")
    if _ENABLED:
        return
    _ENABLED = True
    for name in stub_missing_modules():  # before megatron.training imports megatron.rl
        _say(f"module {name} is not installed: a stand-in module (rl_cpu.py)")
    from megatron_patches.megatron_lm import compat

    compat.enable_python311_support()
    compat.enable_megatron_lm_cpu_support()  # imports megatron.training: after the stand-ins
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
    from megatron.rl import rl_utils

    from megatron_patches.megatron_lm.rl_replay import replay_inference

    cpu_arguments()
    _allow_no_cuda()
    cpu_copies()
    interface = replay_inference()
    rl_utils.get_inference_interface = lambda args, loop, model: interface
    _say("inference interface -> an engine-less one (rollouts are replayed, never generated)")
    if not hasattr(NullTokenizer, "bos_id"):
        NullTokenizer.bos_id = None
        _say("NullTokenizer.bos_id = None (Megatron's NullTokenizer lacks it: no BOS token)")
    GPTModel.forward = cpu_thd_forward(GPTModel.forward)
    _say("GPTModel.forward: train_rl's THD rows run per sequence (Transformer Engine's THD "
         "attention semantics without TE); fp32 only")
