"""Layer groups of the KV cache (kv.groups): by attention type, of equal size, every layer placed
once; the blocks a sequence holds over them (the held-blocks formula)."""
from __future__ import annotations

import pytest

from pagedllm.kv.groups import KV, STATE, STATE_WINDOW, KVGroup, KVLayout, engine_layout, held_blocks, kv_layout, merged


def test_one_attention_type_is_one_group_of_every_layer():
    assert kv_layout([0] * 30) == KVLayout.single(30)
    assert kv_layout([4096] * 32).groups[0].window == 4096 and kv_layout([4096] * 32).layers_per_block == 32


@pytest.mark.parametrize("windows, groups, g", [
    ([0, 0, 64, 64], [(0, (0, 1)), (64, (2, 3))], 2),                       # Qwen2, max_window_layers 2 of 4
    ([512] * 5 + [0] + [512] * 5 + [0] + [512] * 5 + [0],                   # Gemma 3 270M: 5 local to 1 global
     [(0, (5, 11, 17)), (512, (0, 1, 2)), (512, (3, 4, 6)), (512, (7, 8, 9)), (512, (10, 12, 13)),
      (512, (14, 15, 16))], 3),
    ([0] * 21 + [128] * 7, [(0, (0, 1, 2, 3, 4, 5, 6)), (0, tuple(range(7, 14))), (0, tuple(range(14, 21))),
                            (128, tuple(range(21, 28)))], 7),
])
def test_groups_have_the_fewest_layers_of_any_type(windows, groups, g):
    layout = kv_layout(windows)
    assert layout.layers_per_block == g
    placed = sorted(layer for grp in layout.groups for layer in grp.layers)
    assert placed == list(range(len(windows))), "every layer in exactly one group"
    assert all(len(grp.layers) <= g for grp in layout.groups)
    assert all(windows[layer] == grp.window for grp in layout.groups for layer in grp.layers)
    assert layout.groups[0].window == 0, "full attention first"
    assert [(grp.window, grp.layers) for grp in layout.groups] == groups
    for i in range(len(windows)):
        gi, slot = layout.place(i)
        assert layout.groups[gi].layers[slot] == i and slot < g


def test_merged_is_windowed_only_when_every_layer_is():
    assert merged([64, 64]).groups[0].window == 64
    assert merged([0, 64]).groups[0].window == 0 and len(merged([0, 64]).groups) == 1


def test_held_blocks_formula():
    B, W = 16, 64
    n = 1000
    assert held_blocks((0,), n, B) == 63
    assert held_blocks((W,), n, B) == 63 - (n - W) // B == 5
    assert held_blocks((0, W), n, B) == 63 + 5
    assert held_blocks((0, W), 40, B) == 6   # below the window nothing is released
    assert held_blocks((W,), n, B, first_query=0) == 63, "a prefill from position 0 reads every key"


def test_state_layers_get_groups_of_their_own_kind_after_attention():
    # LFM2-350M: 10 short-convolution layers, 6 attention layers among them
    attention = (2, 5, 8, 10, 12, 14)
    state = [i for i in range(16) if i not in attention]
    layout = kv_layout([0] * 16, state)
    assert layout.layers_per_block == 6
    assert [(g.holds, g.window, g.layers) for g in layout.groups] == [
        (KV, 0, attention), (STATE, STATE_WINDOW, tuple(state[:6])), (STATE, STATE_WINDOW, tuple(state[6:]))]
    assert [g.kind for g in layout.groups] == ["full", "state", "state"] and layout.has_state
    assert kv_layout([0] * 4, range(4)).groups == (KVGroup(STATE_WINDOW, (0, 1, 2, 3), STATE),)
    assert not kv_layout([0] * 4).has_state


def test_one_table_layouts_refuse_state_layers():
    with pytest.raises(ValueError, match="reserve-max.*recurrent state.*layers \\[1\\]"):
        engine_layout([0, 0], "reserve-max reserves one table", state_layers=[1])
    assert engine_layout([0, 0], None, state_layers=[1]).kinds == (KV, STATE)
