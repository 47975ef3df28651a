"""tools/capacity.py on Gated DeltaNet hybrids (Qwen3.5 / Qwen3-Next specs): their GDN dims reach
the accounting model (memory_model_gdn.py, held to measured bytes in tests/test_memory_gdn.py),
their parameters are counted per layer kind, and reuse options prefix reuse refuses for GDN
layers (context parallelism) are refused by name; Nemotron-H specs reach it as
their HybridModel pattern with Mamba-2 dims, squared-ReLU MLPs and attention without RoPE
(tools/capacity_specs.py; held to measured bytes in tests/test_memory_nemotron.py)."""
import dataclasses
from types import SimpleNamespace

import pytest

from tools_import import tool


def test_gdn_specs_reach_the_accounting_model():
    capacity = tool("capacity")
    spec = capacity.MODELS["llama3-8b-tiny"]
    capacity.check_modelled(spec)  # no linear_attention_freq: attention only
    assert capacity.dims_of(spec).linear_attention_freq is None
    qwen = capacity.MODELS["qwen3.5-27b"]
    dims = capacity.dims_of(qwen)
    assert (dims.linear_attention_freq, dims.linear_num_value_heads, dims.linear_key_head_dim,
            dims.attention_output_gate) == (4, 48, 128, True)
    model = capacity.activation_models(qwen, capacity.Layout(pp=2), act_bytes=2)
    assert [m.num_mixers("G") for m in model] == [24, 24]
    assert [m.num_mixers("*") for m in model] == [8, 8]
    assert (model[0].first_layer, model[1].first_layer, model[0].rotary_percent) == (0, 32, 0.25)
    assert capacity.dims_of(capacity.MODELS["qwen3-next-80b-a3b"]).moe_shared_ffn_hidden_size == 512
    fields = {f.name: getattr(qwen, f.name) for f in dataclasses.fields(qwen)}
    broken = SimpleNamespace(**{**fields, "name": "no-dims", "linear_num_value_heads": None})
    with pytest.raises(ValueError, match="without the GDN dims"):
        capacity.check_modelled(broken)
    nemotron = capacity.dims_of(capacity.MODELS["nemotron-h-8b"])  # a pattern, not attention
    assert (nemotron.hybrid_pattern.count("M"), nemotron.hybrid_pattern.count("*"),
            nemotron.gated_linear_unit, nemotron.mamba_num_heads, nemotron.mamba_state_dim) == \
        (24, 4, False, 128, 128)
    spec = capacity.MODELS["nemotron-h-8b"]
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    with pytest.raises(ValueError, match="without the Mamba dims"):
        capacity.check_modelled(SimpleNamespace(**{**fields, "mamba_num_heads": None}))


@pytest.mark.parametrize("name, billions", [("qwen3.5-27b", 27), ("qwen3.5-35b-a3b", 35),
                                            ("qwen3-next-80b-a3b", 80), ("nemotron-h-8b", 8)])
def test_parameters_of_gdn_hybrids(name, billions):
    """static_bytes' bf16 weights at TP = PP = EP = 1 are the model's size (its name's billions,
    within 3%): GDN layers counted as GDN, attention layers with their output gate; Nemotron-H's
    pattern layer by layer (Mamba-2 mixers, attention, squared-ReLU MLPs: 8.10B)."""
    capacity = tool("capacity")
    weights = capacity.static_bytes(capacity.MODELS[name], capacity.Layout())["weights"]
    assert weights / 2 / 1e9 == pytest.approx(billions, rel=0.03)


def test_capacity_of_a_gdn_hybrid_counts_every_reuse_option():
    capacity = tool("capacity")
    spec = capacity.MODELS["qwen3.5-27b-tiny"]
    r = capacity.capacity(spec, memory_gib=0.05, group_size=4, prefix_share=0.9,
                          layout=capacity.Layout(dp=1), reserve_gib=0)
    assert r["dense"]["none"] > 0 and r["dense"]["full"] > r["dense"]["none"]
    full = r["reuse"]["full recompute"]
    assert not full.get("refused") and full["trajectory"] > r["dense"]["full"]
    assert r["reuse"]["offload"]["trajectory"] > r["reuse"]["no offload, no recompute"][
        "trajectory"] > r["dense"]["none"]
    assert "refused" not in capacity.format_result(r)
    with pytest.raises(SystemExit) as info:
        capacity.main(["--model", "qwen3.5-27b", "--cp", "2"])
    assert info.value.code == 2


def test_capacity_of_nemotron_h():
    """Nemotron-H 8B on 80 GiB, G = 8, prefix share 0.9 (docs/MEMORY.md): every length finite
    and > 0, full-recompute reuse counted (a HybridModel runs it: tests/test_hybrid_recompute.py)
    and the best reuse option, beyond dense full recompute; reuse beats dense without offload or
    recompute; its attention counted without RoPE, its MLPs without a gate."""
    capacity = tool("capacity")
    spec = capacity.MODELS["nemotron-h-8b"]
    r = capacity.capacity(spec, memory_gib=80, group_size=8, prefix_share=0.9)
    assert all(0 < t < 1 << 24 for t in r["dense"].values())
    full = r["reuse"]["full recompute"]
    assert not full.get("refused") and full["trajectory"] > r["reuse"]["offload"]["trajectory"]
    assert full["trajectory"] > r["dense"]["full"] > 0
    assert "refused" not in capacity.format_result(r)
    assert r["reuse"]["offload"]["trajectory"] > r["reuse"]["no offload, no recompute"][
        "trajectory"] > r["dense"]["none"] > 0
    assert 1 < r["capacity_ratio_plain"] < float("inf") and 0 < r["capacity_ratio"] < float("inf")
    model = capacity.activation_models(spec, capacity.Layout(), act_bytes=2)[0]
    assert (model.rotary_percent, model.num_mixers("M"), model.num_mixers("*")) == (0.0, 24, 4)
    with pytest.raises(SystemExit) as info:
        capacity.main(["--model", "nemotron-h-8b", "--cp", "2"])
    assert info.value.code == 2
