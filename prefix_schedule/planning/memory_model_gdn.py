"""What a Gated DeltaNet layer's mixer half saves for backward, as the GPU path saves it.

[Note: GDN saved tensors] Megatron-core 0.19.2's `GatedDeltaNet.forward`
(megatron/core/ssm/gated_delta_net/gdn.py, common.py) with fla-core 0.6.0's kernels (read in the
PyPI wheel; tests/fla_saved_fake.py cites file and lines), one rank at TP = 1, a = activation
bytes, per token unless said, with qk = HK*dk, vd = HV*dv, D = 2 qk + vd (conv channels):
- input norm and in_proj input: a x 3h + 4 (rstd), as the attention half counts them;
- short conv, dense rows: fla's CausalConv1dFunction saves its x, a strided view of the in_proj
  output, so that whole output stays: a x (2 qk + 2 vd + 2 HV). Reuse rows (the state hook,
  megatron_patches/runtime/gdn_hooks.py): a suffix row is one varlen fla call as above plus one
  initial state [D, W] per sequence (a x D x W); a prefix row runs torch's conv per segment: the
  window [tail; x] (a x D per token, a x (W-1) x D per segment) and the conv output SiLU saves
  (a x D). The reuse bound takes the larger of the two per token and a x D x W per sequence;
- l2norm of q and k (fla L2NormFunction): y (a x 2 qk) and fp32 rstd (4 x 2 HK);
- gates (`_compute_g_and_beta`): softplus input and output (fp32, 2 x 4 HV), sigmoid(beta)
  (a x HV); per forward call exp(A_log) and its negation (2 x a x HV, parameter dtype == a);
- the rule (fla ChunkGatedDeltaRuleFunction): q and k repeated to HV heads (a x 2 HV dk), v
  (a x vd), g's chunk cumsum (fp32, 4 HV), A [T, HV, 64] (a x 64 HV); beta is the tensor
  above. Reuse rows also pass, per packed sequence, an fp32 initial state (4 HV dk dv) and
  cu_seqlens (int64, N + 1) and fla saves chunk_indices (int64 [sum ceil(len / 64), 2]);
- output norm and gate (`_apply_gated_norm`): the rule output and the normed output (a x 2 vd),
  fp32 rstd (4 HV), SiLU of the fp32 gate: its input and output (4 x 2 vd), the product's
  normed-times-weight factor (a x vd), and the out_proj input (a x vd).
Per sequence the bound counts what is per forward call (exp(A_log), cu_seqlens' extra entry)
once per sequence and chunk_indices as 16 B per 64 tokens plus 16 B: exact for one-sequence rows
(dense) up to those <= 16 + 8 + 2 a HV bytes per further packed sequence.

Held to the byte (fp32) by tests/test_memory_gdn.py: one real Megatron GDN layer, and every GDN
mixer of a tiny model's dense and reuse steps, run with fakes that save what fla 0.6.0 saves.
Not measured: what torch.compile (Megatron's `jit_fuser`, eager on CPU) keeps of the three
fused helpers' tensors on a GPU (the gates, the l2norm's surroundings, the output gate), and
Transformer Engine's fused norm + linear (the local modules are counted, as for attention).
"""
from __future__ import annotations

from prefix_schedule.planning.flops import ModelDims
from prefix_schedule.planning.memory_model_mixers import MixerBytes

__all__ = ["gdn_mixer_bytes", "FLA_CHUNK"]

FP32 = 4
INT64 = 8
FLA_CHUNK = 64
"""fla's gated-delta-rule chunk: A is [T, HV, 64]; chunk_indices has one row per chunk."""


def _widths(dims: ModelDims) -> tuple:
    hk, hv = dims.linear_num_key_heads, dims.linear_num_value_heads
    qk, vd = hk * dims.linear_key_head_dim, hv * dims.linear_value_head_dim
    if not (hk and hv and qk and vd and dims.linear_conv_kernel_dim):
        raise ValueError("gdn_mixer_bytes: the model's linear_* GDN dims are not set")
    return hk, hv, qk, vd


def gdn_mixer_bytes(dims: ModelDims, act_bytes: int, *, reuse: bool = False) -> MixerBytes:
    """Saved bytes of one GDN mixer half at TP = 1 ([Note: GDN saved tensors]): `reuse` for the
    rows of a reuse step (the state hook's conv, per-sequence initial states), else dense rows."""
    if isinstance(act_bytes, bool) or not isinstance(act_bytes, int) or act_bytes < 1:
        raise ValueError(f"gdn_mixer_bytes act_bytes={act_bytes!r}; give an int >= 1")
    a, h = act_bytes, dims.hidden_size
    hk, hv, qk, vd = _widths(dims)
    dk, dv, width = dims.linear_key_head_dim, dims.linear_value_head_dim, dims.linear_conv_kernel_dim
    conv_channels = 2 * qk + vd
    norm_in = a * 3 * h + FP32
    fla_conv = a * (2 * qk + 2 * vd + 2 * hv)
    conv = max(fla_conv, a * 2 * conv_channels) if reuse else fla_conv
    l2 = a * 2 * qk + FP32 * 2 * hk
    gates = FP32 * 2 * hv + a * hv
    rule = a * (2 * hv * dk + vd + FLA_CHUNK * hv) + FP32 * hv
    out = a * 4 * vd + FP32 * (hv + 2 * vd)
    per_call = 2 * a * hv  # exp(A_log) and -exp(A_log)
    to_state = norm_in + conv + l2 + gates + rule
    if not reuse:
        return MixerBytes(per_token=to_state + out, to_state_per_token=to_state,
                          per_sequence=per_call)
    indices = 2 * INT64 / FLA_CHUNK  # chunk_indices, per token (its rounding: per sequence)
    per_sequence = FP32 * hv * dk * dv + a * width * conv_channels + \
        INT64 + INT64 + 2 * INT64 + per_call
    return MixerBytes(per_token=to_state + out + indices, to_state_per_token=to_state + indices,
                      per_sequence=per_sequence)
