"""tools/capacity.py on Gated DeltaNet hybrids (Qwen3.5 / Qwen3-Next specs): their GDN dims reach
the accounting model (memory_model_gdn.py, held to measured bytes in tests/test_memory_gdn.py),
their parameters are counted per layer kind, and reuse options prefix reuse refuses for GDN
layers (full recompute, context parallelism) are refused by name; Nemotron-H specs (their
pattern and Mamba dims not yet mapped to ModelDims) are refused, not counted as attention."""
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
    with pytest.raises(ValueError, match="Nemotron-H specs are not mapped to ModelDims yet"):
        capacity.dims_of(capacity.MODELS["nemotron-h-8b-tiny"])  # not counted as attention


@pytest.mark.parametrize("name, billions", [("qwen3.5-27b", 27), ("qwen3.5-35b-a3b", 35),
                                            ("qwen3-next-80b-a3b", 80)])
def test_parameters_of_gdn_hybrids(name, billions):
    """static_bytes' bf16 weights at TP = PP = EP = 1 are the model's size (its name's billions,
    within 3%): GDN layers counted as GDN, attention layers with their output gate."""
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
