"""Megatron's Mamba-2 layers on CPU (the CPU layer's torch kernels, megatron_patches/support/mamba_cpu.py)
against Hugging Face `NemotronHForCausalLM` (its own torch path; shares no code with us), float64,
weights copied: logits and every parameter gradient of a cross-entropy loss.

Megatron's `MambaMixer` trains through mamba-ssm's fused `mamba_split_conv1d_scan_combined`
(gate inside, then the grouped RMS norm, `norm_before_gate=False`); HF's NemotronH mixer runs the
same layer from its own conv, chunked scan and `NemotronHRMSNormGated`. Weights go to HF and
HF's gradients come back through the Nemotron-H checkpoint converter (checkpoints_nemotron.py). HF clamps dt at
`time_step_min` where Megatron's training path does not: the reference's limit is (0, inf)."""
import contextlib
import dataclasses

import pytest
import torch

pytestmark = pytest.mark.megatron

HEADS, HEAD_DIM, STATE, GROUPS, HIDDEN = 4, 8, 16, 2, 32


def _pair(pattern, vocab=97, chunk=8):
    import transformers
    from megatron_patches.models.hybrid import build_hybrid_model
    from megatron_patches.models.tiny import TinyLlamaConfig

    cfg = TinyLlamaConfig(num_layers=0, hidden_size=HIDDEN, ffn_hidden_size=64,
                          num_attention_heads=4, num_query_groups=2, vocab_size=vocab,
                          max_seq_len=128, params_dtype=torch.float64, layernorm_epsilon=1e-5)
    model = build_hybrid_model(cfg, pattern, mamba_state_dim=STATE, mamba_head_dim=HEAD_DIM,
                               mamba_num_groups=GROUPS, mamba_num_heads=HEADS)
    for layer in model.decoder.layers:
        layer.mixer.chunk_size = chunk
    hf_cfg = transformers.NemotronHConfig(
        vocab_size=vocab, hidden_size=HIDDEN, layers_block_type=["mamba"] * len(pattern),
        ssm_state_size=STATE, mamba_num_heads=HEADS, mamba_head_dim=HEAD_DIM, n_groups=GROUPS,
        conv_kernel=4, chunk_size=chunk, layer_norm_epsilon=1e-5,
        use_bias=False, use_conv_bias=True, tie_word_embeddings=False, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64)
    hf = transformers.NemotronHForCausalLM(hf_cfg).double()
    for layer in hf.model.layers:  # Megatron's training path does not clamp dt
        layer.mixer.time_step_limit = (0.0, float("inf"))
    return model, hf, _copy_weights(model, hf, pattern, vocab)


def _spec(pattern, vocab):
    """The ModelSpec of these Mamba-only models (the checkpoint converter's input)."""
    from megatron_patches.models.model_configs import MODELS

    return dataclasses.replace(
        MODELS["nemotron-h-8b-tiny"], name="mamba-hf", num_layers=len(pattern),
        hybrid_layer_pattern=pattern, hidden_size=HIDDEN, vocab_size=vocab,
        mamba_num_heads=HEADS, mamba_head_dim=HEAD_DIM, mamba_state_dim=STATE,
        mamba_num_groups=GROUPS, rms_norm_eps=1e-5)


def _copy_weights(model, hf, pattern, vocab):
    """Megatron's weights into HF through the checkpoint converter
    (megatron_patches/models/checkpoints_nemotron.py: HF `backbone.*` = transformers' `model.*`),
    A_log made a generic value on both sides (the inits differ); returns (the spec, the layout)."""
    from megatron_patches.models.checkpoints import RankLayout, to_hf, to_megatron

    spec, layout = _spec(pattern, vocab), RankLayout(padded_vocab_size=vocab)
    ours = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in ours.items():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.5)
    tensors = to_hf(spec, [[{n: p.detach() for n, p in ours.items()}]], layout)
    assert to_megatron(spec, tensors, layout).keys() == ours.keys()  # every parameter mapped
    theirs = dict(hf.named_parameters())
    assert {n.replace("backbone.", "model.", 1) for n in tensors} == set(theirs)
    with torch.no_grad():
        for name, t in tensors.items():
            theirs[name.replace("backbone.", "model.", 1)].copy_(t)
    return spec, layout


@contextlib.contextmanager
def _float64_upcasts():
    """Both sides up-cast to fp32 inside with `.float()` (HF: its chunked scan and the logits;
    Megatron's mixer: A_log, dt_bias, D; both norms `.to(torch.float32)`); in float64 those
    up-casts keep float64."""
    original_float, original_to = torch.Tensor.float, torch.Tensor.to

    def keep_float64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else original_float(self, *args, **kwargs)

    def to_keeping_float64(self, *args, **kwargs):
        wants = kwargs.get("dtype", args[0] if args and isinstance(args[0], torch.dtype) else None)
        if self.dtype == torch.float64 and wants == torch.float32:
            return self
        return original_to(self, *args, **kwargs)

    torch.Tensor.float, torch.Tensor.to = keep_float64, to_keeping_float64
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to = original_float, original_to


@pytest.mark.parametrize("pattern,length", [("M", 13), ("MM", 21), ("MMM", 5)])
def test_mamba_layers_match_hugging_face_nemotron_h(megatron_env, pattern, length):
    from megatron_patches.models.checkpoints import to_megatron

    model, hf, (spec, layout) = _pair(pattern)
    tokens = torch.randint(0, 97, (1, length))
    labels = torch.randint(0, 97, (1, length))
    pos = torch.arange(length)[None]
    with _float64_upcasts():  # Megatron's mixer up-casts A_log, dt_bias and D with .float()
        logits = model(tokens, pos, None)  # [b, s, V]
        loss = torch.nn.functional.cross_entropy(logits[0], labels[0])
        loss.backward()
    with _float64_upcasts():
        hf_logits = hf(input_ids=tokens, use_cache=False).logits
        hf_loss = torch.nn.functional.cross_entropy(hf_logits[0], labels[0])
        hf_loss.backward()
    assert torch.isfinite(logits).all() and torch.isfinite(hf_logits).all()
    torch.testing.assert_close(logits, hf_logits, rtol=1e-9, atol=1e-9)
    theirs = {n.replace("model.", "backbone.", 1): p.grad for n, p in hf.named_parameters()}
    assert all(g is not None for g in theirs.values())
    wants = to_megatron(spec, theirs, layout)  # HF's gradients in Megatron's layout
    for m, p in model.named_parameters():
        want = wants[m]
        assert p.grad is not None, m
        assert torch.isfinite(p.grad).all(), m
        scale = want.abs().max().clamp_min(1e-30)
        err = ((p.grad.reshape(want.shape) - want).abs().max() / scale).item()
        assert err <= 1e-9, (m, err)
