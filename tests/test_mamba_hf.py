"""Megatron's Mamba-2 layers on CPU (the CPU layer's torch kernels, megatron_patches/support/mamba_cpu.py)
against Hugging Face `NemotronHForCausalLM` (its own torch path; shares no code with us), float64,
weights copied: logits and every parameter gradient of a cross-entropy loss.

Megatron's `MambaMixer` trains through mamba-ssm's fused `mamba_split_conv1d_scan_combined`
(gate inside, then the grouped RMS norm, `norm_before_gate=False`); HF's NemotronH mixer runs the
same layer from its own conv, chunked scan and `NemotronHRMSNormGated`. HF clamps dt at
`time_step_min` where Megatron's training path does not: the reference's limit is (0, inf)."""
import contextlib

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
    return model, hf, _copy_weights(model, hf)


def _copy_weights(model, hf):
    """Megatron name -> HF name, copying Megatron's weights into HF (same layouts)."""
    names = {"embedding.word_embeddings.weight": "model.embeddings.weight",
             "decoder.final_norm.weight": "model.norm_f.weight",
             "output_layer.weight": "lm_head.weight"}
    for i, _ in enumerate(model.decoder.layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        names.update({m + "norm.weight": h + "norm.weight",
                      m + "mixer.in_proj.weight": h + "mixer.in_proj.weight",
                      m + "mixer.conv1d_weight": h + "mixer.conv1d.weight",
                      m + "mixer.conv1d_bias": h + "mixer.conv1d.bias",
                      m + "mixer.dt_bias": h + "mixer.dt_bias", m + "mixer.A_log": h + "mixer.A_log",
                      m + "mixer.D": h + "mixer.D", m + "mixer.norm.weight": h + "mixer.norm.weight",
                      m + "mixer.out_proj.weight": h + "mixer.out_proj.weight"})
    ours = dict(model.named_parameters())
    theirs = dict(hf.named_parameters())
    assert set(ours) == set(names), sorted(set(ours) ^ set(names))
    with torch.no_grad():
        for m, h in names.items():
            theirs[h].copy_(ours[m].detach().to(theirs[h].dtype).reshape(theirs[h].shape))
            if m.endswith("A_log"):  # init differs: make it a generic value on both sides
                ours[m].uniform_(-1.0, 1.5)
                theirs[h].copy_(ours[m])
    return names


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
    model, hf, names = _pair(pattern)
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
    theirs = dict(hf.named_parameters())
    for m, p in model.named_parameters():
        want = theirs[names[m]].grad
        assert p.grad is not None and want is not None, m
        assert torch.isfinite(p.grad).all(), m
        scale = want.abs().max().clamp_min(1e-30)
        err = ((p.grad.reshape(want.shape) - want).abs().max() / scale).item()
        assert err <= 1e-9, (m, err)
