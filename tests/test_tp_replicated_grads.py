"""Gradients of TP-replicated weights at TP=2 without sequence parallelism ([Note: replicated
weights with partial gradients] in megatron_patches/runtime/tp_grads.py, issue 36).

Per model family (Llama, Qwen3 with q/k norms, the Qwen3.5 GDN hybrid, the Nemotron-H Mamba
hybrid): a TP=1 model in this
process (the reference: no TP, so every gradient is whole) gives its weights, through the HF
checkpoint converters, to a TP=2 model on two gloo ranks; both run stock Megatron's dense step
(Megatron's DDP and finalize_model_grads at TP=2) on the same batch. Every parameter that is
not TP-sharded must have the same gradient on both ranks and the TP=1 gradient (fp32 1e-5 of
its max). Without the tp-grad-sum-hook the GDN out_norm gradient is each rank's local heads'
part only, and this fails.
"""
import dataclasses

import pytest
import torch

from dist_harness import DistributedRunError, run_distributed
from test_equivalence import LOSS, make_batch

pytestmark = pytest.mark.megatron

FAMILIES = ("llama3-8b-tiny", "qwen3-8b-tiny", "qwen3.5-27b-tiny", "nemotron-h-8b-tiny")
SHAPES = [(12, [5, 4]), (9, [6])]
TOL = 1e-5


def _spec(name):
    from megatron_patches.models.model_configs import MODELS
    return dataclasses.replace(MODELS[name], tie_word_embeddings=False)


def _build(spec):
    if spec.is_gdn:
        from test_hf_checkpoints_gdn import _megatron_model
        return _megatron_model(spec).float()
    if spec.is_nemotron_h:
        from test_hf_checkpoints_nemotron import megatron_model
        return megatron_model(spec, dtype=torch.float32)
    from test_hf_checkpoints import _build as build_gpt
    return build_gpt(spec)


def _every_family(weights, tp):
    """`_replicated_grads` of each family of `weights` (name -> HF tensors): one launch."""
    return {name: _replicated_grads(name, hf, tp) for name, hf in weights.items()}


def _replicated_grads(name, hf, tp):
    """This rank's model of family `name` with the weights `hf`; stock dense step; the
    gradients of its parameters that are not TP-sharded."""
    import megatron_patches
    from megatron_patches.models.checkpoints import to_megatron
    from megatron_patches.models.hf_checkpoints import rank_layout
    from megatron_patches.models.tiny import initialize_distributed
    from megatron_patches.training import dense_step, param_grads, prepare_for_training, zero_grads

    megatron_patches.install()
    if tp > 1:
        initialize_distributed(seed=1234, tp=tp)
    spec = _spec(name)
    model = _build(spec)
    with torch.no_grad():
        for key, value in to_megatron(spec, hf, rank_layout(model)).items():
            dict(model.named_parameters())[key].copy_(value)
    replicated = {n for n, p in model.named_parameters()
                  if not getattr(p, "tensor_model_parallel", False)}
    model = prepare_for_training(model, ddp=tp > 1)
    zero_grads(model)
    dense_step(model, make_batch(7, SHAPES), LOSS)
    grads = {n.removeprefix("module."): g for n, g in param_grads(model).items()}
    return {n: grads[n] for n in replicated}


def _hf_weights(name):
    """The TP=1 model's weights as HF tensors (the converters' own round trip is tested in
    tests/test_hf_checkpoints*.py)."""
    from megatron_patches.models.checkpoints import to_hf
    from megatron_patches.models.hf_checkpoints import rank_layout
    spec = _spec(name)
    model = _build(spec)
    state = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return to_hf(spec, [[state]], rank_layout(model))


def test_replicated_grads_are_whole_at_tp2(megatron_env):
    weights = {name: _hf_weights(name) for name in FAMILIES}
    reference = {name: _replicated_grads(name, hf, tp=1) for name, hf in weights.items()}
    try:
        ranks = run_distributed(_every_family, world_size=2, args=(weights, 2), timeout_s=300)
    except DistributedRunError as error:
        pytest.fail(str(error))
    for name in FAMILIES:
        _check_family(name, reference[name], [r[name] for r in ranks])


def _check_family(name, reference, ranks):
    assert set(ranks[0]) == set(ranks[1]) and set(ranks[0]) <= set(reference)
    checked = []
    for key in ranks[0]:
        ref = reference[key]
        scale = float(ref.abs().max())
        assert scale > 0 and bool(torch.isfinite(ref).all()), key
        for rank, grads in enumerate(ranks):
            diff = float((grads[key] - ref).abs().max())
            assert diff <= TOL * scale, f"{name} {key} rank {rank}: {diff:.3e} vs max {scale:.3e}"
        checked.append(key)
    if _spec(name).is_gdn:
        assert any(".out_norm." in k for k in checked), checked
