"""The FLOP model counts sliding windows (gpt-oss: window_size (W, 0) on alternate layers) by the
pairs a window sees; the memory model refuses windowed models by name."""
import pytest

from prefix_schedule.planning.flops import ModelDims, _prefix_forward, _row_forward
from prefix_schedule.planning.flops_layers import layer_window

BASE = dict(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
            num_query_groups=2, vocab_size=256, gated_linear_unit=True)


def _brute_pairs(length, cached, window):
    return sum(min(p + 1, window + 1) if window is not None else p + 1
               for p in range(cached, cached + length))


@pytest.mark.parametrize("length, cached", [(1, 0), (1, 40), (7, 3), (30, 0), (12, 100)])
def test_windowed_rows_count_only_the_pairs_a_window_sees(length, cached):
    full = ModelDims(**BASE)
    win = ModelDims(**BASE, window_size=5, window_attn_skip_freq=2)
    assert [layer_window(win, i) for i in range(4)] == [5, None, 5, None]
    per_pair = 4 * 64  # 4 * a * d FLOPs per (query, key) pair and layer
    saved = 2 * per_pair * (_brute_pairs(length, cached, None) - _brute_pairs(length, cached, 5))
    assert _row_forward(full, length, cached) - _row_forward(win, length, cached) == saved
    every = ModelDims(**BASE, window_size=5)  # no skip freq: every layer windowed
    assert _row_forward(full, length, cached) - _row_forward(every, length, cached) == 2 * saved
    assert _prefix_forward(win, length, cached) <= _prefix_forward(full, length, cached)


def test_memory_model_refuses_windows_by_name():
    from prefix_schedule.planning.memory_model import ActivationModel

    with pytest.raises(ValueError, match="window_size=5"):
        ActivationModel(dims=ModelDims(**BASE, window_size=5), act_bytes=4)
    with pytest.raises(ValueError, match="window_size"):
        ModelDims(**BASE, window_size=-1)
