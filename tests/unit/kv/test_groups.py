"""Layer groups of the KV cache (kv.groups): by attention type, of equal size, every layer placed
once; the blocks a sequence holds over them (the held-blocks formula)."""
from __future__ import annotations

import pytest

from pagedllm.kv.groups import KVLayout, held_blocks, kv_layout, merged


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
