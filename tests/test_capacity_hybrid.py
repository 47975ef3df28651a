"""tools/capacity.py refuses models with Gated DeltaNet layers (a ModelSpec's
`linear_attention_freq`), whose state cache and per-token saved tensors the accounting model does
not count yet, instead of counting K/V for them."""
import dataclasses
from types import SimpleNamespace

import pytest

from tools_import import tool


def test_gdn_specs_are_refused_and_attention_specs_pass():
    capacity = tool("capacity")
    spec = capacity.MODELS["llama3-8b-tiny"]
    capacity.check_modelled(spec)  # no linear_attention_freq: attention only
    assert capacity.dims_of(spec).num_layers == spec.num_layers
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    gdn = SimpleNamespace(**{**fields, "name": "qwen3.5-like", "linear_attention_freq": 4})
    with pytest.raises(ValueError, match="not in the memory model yet"):
        capacity.check_modelled(gdn)
    with pytest.raises(ValueError, match="linear_attention_freq=4"):
        capacity.dims_of(gdn)
    capacity.check_modelled(SimpleNamespace(**{**fields, "linear_attention_freq": 0}))
