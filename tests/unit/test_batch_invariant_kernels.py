"""Batch-invariant mode (--batch-invariant): a request's greedy tokens in bf16 are the same
run alone, in any batch, and after preemption and recompute; and the pieces that make it
so (matmuls, attention) give a row the same bits whatever else is in the call."""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.config import EngineConfig
from pagedllm.kernels import load_ops
from pagedllm.models.batch_invariant import ROW_TILE, can_pack, invariant_linear, pack_weight, tiled_linear
from pagedllm.models.prepack import can_prepack, panels_wanted, prepack_linears


# ShareGPT-like: questions, instructions, pasted text and code, many short, a few long.


# --- the pieces --------------------------------------------------------------

SHAPES = [(576, 960), (1536, 576), (576, 4096)]   # SmolLM2's qkv and down_proj; a wide one like lm_head


def _linears(kernels, dtype: torch.dtype):
    """(name, f(x, w, packed w)) for each batch-invariant matmul this machine runs in dtype."""
    out = [("tiled", lambda x, w, p: tiled_linear(x, w))]
    if can_prepack(torch.zeros(32, 32, dtype=dtype)):
        layers: dict[int, nn.Linear] = {}

        def reordered(x, w, p):  # the same tiles on the weight reordered for oneDNN (models/prepack.py)
            if w.data_ptr() not in layers:
                layer = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
                layer.weight = nn.Parameter(w.clone(), requires_grad=False)
                prepack_linears(layer, keep=set(), single=True)
                layers[w.data_ptr()] = layer
            return invariant_linear(layers[w.data_ptr()], x, kernels)
        out.append(("tiled, reordered", reordered))
    if dtype == torch.bfloat16 and panels_wanted(kernels):
        panel_layers: dict[int, nn.Linear] = {}

        def panels(x, w, p):  # our kernel on the weight packed in panels: invariant with no tiles
            if w.data_ptr() not in panel_layers:
                layer = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
                layer.weight = nn.Parameter(w.clone(), requires_grad=False)
                with mock.patch.dict(os.environ, {"PAGEDLLM_PREPACK": "panels"}):   # whatever the chooser would time
                    assert prepack_linears(layer, keep=set(), kernels=kernels, single=True) == 1
                assert hasattr(layer, "panels") and layer.route.paths == ("panels",)
                panel_layers[w.data_ptr()] = layer
            return invariant_linear(panel_layers[w.data_ptr()], x, kernels)
        out.append(("panels", panels))
    if can_pack(torch.zeros(32, 32, dtype=dtype), kernels):
        def amx(x, w, p):
            y = x.new_empty(x.shape[0], w.shape[0])
            kernels.invariant_linear(y, x, p, None)
            return y
        out.append(("amx", amx))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k,n", SHAPES)
def test_matmul_row_independent_of_the_batch(k, n, dtype):
    """A row's result: the same alone, among 2..300 rows, at any place of a tile, on 1 or 2
    threads (plain F.linear fails this from 33 rows in bf16, from 2 in fp32)."""
    kernels = load_ops()
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    x = torch.randn(300, k, generator=g).to(dtype)
    packed = pack_weight(w)
    threads = torch.get_num_threads()
    for name, f in _linears(kernels, dtype):
        alone = torch.cat([f(x[i:i + 1], w, packed) for i in range(40)])
        for m in (2, 7, ROW_TILE - 1, ROW_TILE + 1, 100, 300):
            assert torch.equal(f(x[:m], w, packed)[:40], alone[:m]), f"{name}: rows changed in a call of {m} rows"
        shifted = f(torch.cat([x[200:213], x[:40]]), w, packed)[13:]
        assert torch.equal(shifted, alone), f"{name}: a row's result depends on its place in the tile"
        torch.set_num_threads(1)
        try:
            assert torch.equal(f(x[:40], w, packed), alone), f"{name}: result depends on the thread count"
        finally:
            torch.set_num_threads(threads)
        torch.testing.assert_close(f(x, w, packed).float(), F.linear(x.float(), w.float()), atol=0.05, rtol=0.02)


def test_amx_matmul_with_bias_and_ragged_columns():
    """The AMX kernel with a bias and a part-filled panel; on a CPU without AMX, the tiled
    matmul that runs there instead, with the same bias and ragged columns (a skip would
    fail under CI=true on such a machine, and test nothing)."""
    kernels = load_ops()
    w = (torch.randn(40, 64) * 0.1).bfloat16()   # 40 columns: a part-filled panel
    b = torch.randn(40).bfloat16()
    x = torch.randn(19, 64).bfloat16()
    if can_pack(w, kernels):
        y = torch.empty(19, 40, dtype=torch.bfloat16)
        kernels.invariant_linear(y, x, pack_weight(w), b)
    else:
        y = tiled_linear(x, w, b)
        assert torch.equal(tiled_linear(x[:7], w, b), y[:7]), "a row's result depends on the rows beside it"
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float(), b.float()), atol=0.03, rtol=0.02)


def test_attention_row_same_in_prefill_chunk_and_decode():
    """Query rows of one sequence (750 keys: past a 512-key chunk), computed in prefill
    chunks of any size, beside other sequences, or one by one as decodes: the same bits."""
    from pagedllm.attention.cpu_backend import CpuPagedAttention

    kernels = load_ops()
    g = torch.Generator().manual_seed(0)
    h, kvh, d, bs, ctx = 9, 3, 64, 16, 750
    k_shape, v_shape = CpuPagedAttention().cache_shapes(64, bs, kvh, d, torch.bfloat16)
    kc, vc = torch.zeros(k_shape, dtype=torch.bfloat16), torch.zeros(v_shape, dtype=torch.bfloat16)
    table = torch.randperm(64, generator=g)[:-(-ctx // bs)].to(torch.int32)
    slots = (table.long()[:, None] * bs + torch.arange(bs)).flatten()[:ctx]
    k, v = torch.randn(ctx, kvh, d, generator=g).bfloat16(), torch.randn(ctx, kvh, d, generator=g).bfloat16()
    kernels.write_kv(k, v, kc, vc, slots)
    q = torch.randn(ctx, h, d, generator=g).bfloat16()

    def run(seqs: list[tuple[int, int]]) -> torch.Tensor:
        """One step of the same sequence's queries [a, b) (b keys) for each (a, b) of seqs,
        as batch-invariant mode runs it (no split-K)."""
        qs = torch.cat([q[a:b] for a, b in seqs])
        starts = torch.tensor([0] + [b - a for a, b in seqs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        out = torch.empty_like(qs)
        kernels.paged_attention(out, qs, kc, vc, table.repeat(len(seqs), 1),
                                torch.tensor([b for _, b in seqs], dtype=torch.int32), starts, d ** -0.5, False)
        return out

    whole = run([(0, ctx)])
    for pos in (0, 15, 16, 511, 512, 513, 700, ctx - 1):
        assert torch.equal(run([(pos, pos + 1)])[0], whole[pos]), f"decode of position {pos} differs"
    chunks = run([(500, 530), (0, 64), (730, ctx), (511, 512)])
    assert torch.equal(chunks[:30], whole[500:530]) and torch.equal(chunks[30:94], whole[:64])
    assert torch.equal(chunks[94:114], whole[730:]) and torch.equal(chunks[114], whole[511])


def test_config_rejects_backends_without_the_mode():
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant=True, attention_backend="torch")
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant="yes")
    assert EngineConfig(batch_invariant=True).batch_invariant
