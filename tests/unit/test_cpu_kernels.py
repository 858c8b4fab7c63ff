"""The compiled CPU kernels against the torch reference: paged attention (its own block
layout) equals the reference backend on the same logical KV, and the fused norm / SiLU /
RoPE ops equal the torch expressions they replace."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention import StepLayout, get_backend
from pagedllm.kernels import load_ops
from pagedllm.models.rope import RotaryEmbedding, apply_rope


def build_step(seqs, heads, block_size, dtype, g, pad_rows_to=0):
    """KV pools for both backends holding each sequence's cached prefix, and the step's
    inputs: seqs = [(cached, new)], decodes ordered first as the runner does."""
    h, kvh, d = heads
    ref, cpu = get_backend("torch"), get_backend("cpu")
    ref.decode_group = 4  # several decode groups in one step
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    # Stale data everywhere: a kernel reading outside its blocks or slots would show.
    ref_k = torch.randn(ref.cache_shapes(num_blocks, block_size, kvh, d, dtype)[0], generator=g).to(dtype)
    ref_v = torch.randn(ref.cache_shapes(num_blocks, block_size, kvh, d, dtype)[1], generator=g).to(dtype)
    cpu_k = torch.randn(cpu.cache_shapes(num_blocks, block_size, kvh, d, dtype)[0], generator=g).to(dtype)
    cpu_v = torch.randn(cpu.cache_shapes(num_blocks, block_size, kvh, d, dtype)[1], generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()  # scattered physical blocks
    order = sorted(range(len(seqs)), key=lambda i: (seqs[i][1] != 1, sum(seqs[i])))
    qs, ks, vs, slots, tables, lens, starts = [], [], [], [], [], [], [0]
    for i in order:
        cached, new = seqs[i]
        n = cached + new
        table = [free.pop() for _ in range(-(-n // block_size))]
        k_all = torch.randn(n, kvh, d, generator=g).to(dtype)
        v_all = torch.randn(n, kvh, d, generator=g).to(dtype)
        if cached:  # the prefix's KV is already in both pools, written by each backend's own writer
            pre = [table[j // block_size] * block_size + j % block_size for j in range(cached)]
            from pagedllm.attention.torch_ref import write_kv
            write_kv(k_all[:cached], v_all[:cached], ref_k, ref_v, torch.tensor(pre))
            load_ops().write_kv(k_all[:cached], v_all[:cached], cpu_k, cpu_v, torch.tensor(pre))
        qs.append(torch.randn(new, h, d, generator=g).to(dtype))
        ks.append(k_all[cached:])
        vs.append(v_all[cached:])
        slots += [table[j // block_size] * block_size + j % block_size for j in range(cached, n)]
        tables.append(table)
        lens.append(n)
        starts.append(starts[-1] + new)
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    pad = pad_rows_to - len(q) if pad_rows_to else 0
    nd = sum(1 for i in order if seqs[i][1] == 1)
    layout = StepLayout(slots + [-1] * pad, tables, lens, starts, nd)
    return (ref, ref_k, ref_v), (cpu, cpu_k, cpu_v), q, k, v, layout, pad


def attend(backend, q, k, v, k_cache, v_cache, layout: StepLayout, scale: float):
    """The backend's attention over the step, through its own metadata."""
    return backend.forward(q, k, v, k_cache, v_cache, backend.build_metadata(layout, "cpu"), scale)


# (cached prefix, new tokens): decodes (one at context 1), a fresh prefill, a chunk over
# a cached prefix, a chunk longer than a query tile, a long decode.
SEQS = [(40, 1), (7, 1), (0, 1), (300, 1), (0, 23), (33, 9), (64, 64), (5, 2), (17, 70)]


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 2, 128)], ids=["gqa3-64", "mha-32", "gqa4-128"])
def test_cpu_attention_equals_reference(block_size, dtype, heads):
    g = torch.Generator().manual_seed(block_size + heads[2])
    (ref, rk, rv), (cpu, ck, cv), q, k, v, layout, _ = build_step(SEQS, heads, block_size, dtype, g)
    scale = heads[2] ** -0.5
    want = attend(ref, q, k, v, rk, rv, layout, scale)
    got = attend(cpu, q, k, v, ck, cv, layout, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [1, 2])
def test_long_decodes_split_across_threads(threads):
    """Few long decodes: keys are split into parts merged afterwards (split-K)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        (ref, rk, rv), (cpu, ck, cv), q, k, v, layout, _ = build_step([(3000, 1), (1200, 1)], (9, 3, 64), 16,
                                                                      torch.float32, g)
        torch.testing.assert_close(attend(cpu, q, k, v, ck, cv, layout, 0.125),
                                   attend(ref, q, k, v, rk, rv, layout, 0.125), atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_equal_the_reference(dtype):
    """gpt-oss's attention sinks (a logit per head in each row's softmax) on the kernel: the
    reference's result over decodes, prefill chunks with and without a cached prefix, long decodes
    split across the threads (the sink joins the merge's denominator once) and a sliding window."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(11)
        heads = (8, 2, 64)
        sinks = torch.randn(heads[0], generator=g) * 2
        for window in (0, 48):
            (ref, rk, rv), (cpu, ck, cv), q, k, v, layout, _ = build_step(SEQS[:3] + [(3000, 1), (33, 9), (0, 23)],
                                                                          heads, 16, dtype, g)
            want = ref.forward(q, k, v, rk, rv, ref.build_metadata(layout, "cpu"), 0.125, window, sinks)
            got = cpu.forward(q, k, v, ck, cv, cpu.build_metadata(layout, "cpu"), 0.125, window, sinks)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            plain = ref.forward(q, k, v, rk, rv, ref.build_metadata(layout, "cpu"), 0.125, window)
            assert (plain.float() - want.float()).abs().max() > 10 * tol, "the sinks changed nothing: the test shows nothing"
    finally:
        torch.set_num_threads(old)


def test_a_split_decode_sums_alike_whatever_the_threads_that_run_it():
    """plan_threads (the engine's configured count) fixes the split-K plan: one long decode gives
    the same bits on 1 thread and on 2, as when the governor drops a thread mid-request; planned for
    the count of the moment, 1 and 2 threads split it differently (the reason for the knob)."""
    old = torch.get_num_threads()
    g = torch.Generator().manual_seed(5)
    _, (cpu, ck, cv), q, k, v, layout, _ = build_step([(3000, 1)], (9, 3, 64), 16, torch.bfloat16, g)
    meta = cpu.build_metadata(layout, "cpu")
    cpu.ops.write_kv(k, v, ck, cv, meta.slot_mapping)

    def run(threads: int, plan: int) -> torch.Tensor:
        torch.set_num_threads(threads)
        out = torch.empty_like(q)
        cpu.ops.paged_attention(out, q, ck, cv, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125, True,
                                0, 0, plan)
        return out

    try:
        assert torch.equal(run(1, 2), run(2, 2))
        assert torch.equal(run(2, 0), run(2, 2))   # unthrottled, the plan is the one it always was
        assert not torch.equal(run(1, 0), run(2, 0)), "1 and 2 threads planned alike: the test shows nothing"
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("path", ["paged", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_chunks_on_either_path_equal_the_reference(path, dtype):
    """The step's trailing chunks with no keys before them (fresh prompts) on torch's flash
    attention (attention/fresh_prefill.py) or on the kernel, whichever the route says, beside
    decodes and a chunk over a cached prefix: the reference's result either way, padding rows
    zero, every chunk's K/V in its blocks."""
    from pagedllm.kernels.chooser import Route

    g = torch.Generator().manual_seed(11)
    seqs = [(40, 1), (300, 1), (3, 9), (0, 23), (0, 33), (0, 70)]
    (ref, rk, rv), (cpu, ck, cv), q, k, v, layout, pad = build_step(seqs, (9, 3, 64), 16, dtype, g, pad_rows_to=160)
    cpu._routes[(9, 3, 64, dtype)] = Route((path,))
    n = len(q)
    qp, kp, vp = (torch.cat([t, torch.randn(pad, *t.shape[1:]).to(dtype)]) for t in (q, k, v))
    meta = cpu.build_metadata(layout, "cpu")
    assert [m for _, _, m in meta.fresh] == [23, 33, 70]
    got = cpu.forward(qp, kp, vp, ck, cv, meta, 0.125)
    unpadded = dataclasses.replace(layout, slots=layout.slots[:n])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[:n].float(), attend(ref, q, k, v, rk, rv, unpadded, 0.125).float(), atol=tol, rtol=tol)
    assert torch.equal(got[n:], torch.zeros_like(got[n:]))
    again = cpu.forward(q[-1:], k[-1:], v[-1:], ck, cv, cpu.build_metadata(StepLayout(
        [-1], [layout.block_tables[-1]], [70], [0, 1], 1), "cpu"), 0.125)   # the last key, read from its block
    assert torch.allclose(again.float(), got[n - 1:n].float(), atol=tol, rtol=tol)


def test_padding_rows_are_zero_and_write_nothing():
    g = torch.Generator().manual_seed(3)
    (ref, rk, rv), (cpu, ck, cv), q, k, v, layout, pad = build_step([(10, 1), (0, 5)], (9, 3, 64), 16,
                                                                    torch.float32, g, pad_rows_to=16)
    n = len(q)
    qp = torch.cat([q, torch.randn(pad, *q.shape[1:])])
    kp, vp = torch.cat([k, torch.randn(pad, *k.shape[1:])]), torch.cat([v, torch.randn(pad, *v.shape[1:])])
    before = ck.clone(), cv.clone()
    out = attend(cpu, qp, kp, vp, ck, cv, layout, 0.125)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    changed = (ck != before[0]).any(dim=(1, 2, 3)).sum() + (cv != before[1]).any(dim=(1, 2, 3)).sum()
    assert changed <= 2 * 2  # only the blocks of the real tokens' slots (one per sequence, K and V)
    unpadded = dataclasses.replace(layout, slots=layout.slots[:n])
    torch.testing.assert_close(out[:n], attend(ref, q, k, v, rk, rv, unpadded, 0.125), atol=1e-5, rtol=1e-5)


def test_bad_tables_and_slots_are_errors_not_crashes():
    ops = load_ops()
    kc, vc = torch.zeros(4, 3, 64, 16, 1), torch.zeros(4, 3, 16, 64, 1)
    q = torch.zeros(1, 9, 64)
    lens, starts = torch.tensor([5], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.paged_attention(torch.empty_like(q), q, kc, vc, torch.tensor([[7]], dtype=torch.int32), lens, starts, 1.0)
    with pytest.raises(RuntimeError, match="keys for a table"):
        ops.paged_attention(torch.empty_like(q), q, kc, vc, torch.tensor([[0]], dtype=torch.int32),
                            torch.tensor([40], dtype=torch.int32), starts, 1.0)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.write_kv(torch.zeros(1, 3, 64), torch.zeros(1, 3, 64), kc, vc, torch.tensor([64]))
    with pytest.raises(RuntimeError, match="head_dim"):
        ops.paged_attention(torch.empty(1, 9, 48), torch.zeros(1, 9, 48), torch.zeros(4, 3, 48, 16, 1),
                            torch.zeros(4, 3, 16, 48, 1), torch.tensor([[0]], dtype=torch.int32), lens, starts, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_fused_elementwise_equal_torch(dtype, rows):
    ops = load_ops()
    g = torch.Generator().manual_seed(rows)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    res = torch.randn(rows, 576, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-5)
    torch.testing.assert_close(out.float(), F.rms_norm(x.float(), (576,), w.float(), 1e-5), **tol)

    x2, r2 = x.clone(), res.clone()
    ops.add_rms_norm(x2, r2, w, 1e-5)
    summed = (x + res)  # rounded to dtype, as the unfused add is
    assert torch.equal(r2, summed)
    torch.testing.assert_close(x2.float(), F.rms_norm(summed.float(), (576,), w.float(), 1e-5), **tol)

    gu = (3 * torch.randn(rows, 2 * 1536, generator=g)).to(dtype)
    act = torch.empty(rows, 1536, dtype=dtype)
    ops.silu_and_mul(act, gu)
    gate, up = gu.float().chunk(2, dim=-1)
    torch.testing.assert_close(act.float(), F.silu(gate) * up, **tol)
    ops.gelu_tanh_and_mul(act, gu)  # Gemma's gate
    torch.testing.assert_close(act.float(), F.gelu(gate, approximate="tanh") * up, **tol)

    rope = RotaryEmbedding(64, 4096, 10000.0, None)
    pos = torch.randint(0, 4096, (rows,), generator=g)
    qkv = torch.randn(rows, (9 + 6) * 64, generator=g).to(dtype)  # q and k as views of one buffer
    q, k = qkv[:, :576].view(rows, 9, 64), qkv[:, 576:768].view(rows, 3, 64)
    cos, sin = rope(pos, torch.float32)
    want_q, want_k = apply_rope(q.float(), cos, sin), apply_rope(k.float(), cos, sin)
    v_before = qkv[:, 768:].clone()
    ops.rope(q, k, pos, rope.cos, rope.sin)
    torch.testing.assert_close(q.float(), want_q, **tol)
    torch.testing.assert_close(k.float(), want_k, **tol)
    assert torch.equal(qkv[:, 768:], v_before)
    with pytest.raises(RuntimeError, match="outside the table"):
        ops.rope(q, k, torch.full((rows,), 4096), rope.cos, rope.sin)

    # Partial rotary (Phi-4-mini turns 3/4 of a head): the kernel on views of the first 32 dims.
    part = RotaryEmbedding(32, 4096, 10000.0, None)
    cos, sin = part(pos, torch.float32)
    want_q, want_k = apply_rope(q.float(), cos, sin), apply_rope(k.float(), cos, sin)
    ops.rope(q[..., :32], k[..., :32], pos, part.cos, part.sin)
    torch.testing.assert_close(q.float(), want_q, **tol)
    torch.testing.assert_close(k.float(), want_k, **tol)


@pytest.mark.parametrize("k", [0, 1, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_score_rows_equal_log_softmax(dtype, k):
    """Prompt scoring: each row's token logprob and rank, and its top k, as log_softmax, a
    count and topk give them; a row's answers the same alone as in a batch."""
    ops, g = load_ops(), torch.Generator().manual_seed(3)
    V = 4099  # not a multiple of 16: the tail lanes
    x = (4 * torch.randn(37, V, generator=g)).to(dtype)
    x[3] = 1.0  # a row of ties
    want = torch.randint(0, V, (37,), generator=g)
    lp, rank, ids, vals = ops.score_rows(x, want, k)
    xf = x.float()
    ref = torch.log_softmax(xf, dim=-1)
    chosen = xf.gather(1, want[:, None])
    torch.testing.assert_close(lp, ref.gather(1, want[:, None])[:, 0], atol=2e-5, rtol=0)
    assert torch.equal(rank, (xf > chosen).sum(-1).int() + 1)
    assert ids.shape == vals.shape == (37, k) and ids.dtype == rank.dtype == torch.int32
    if k:
        top = torch.topk(xf, k, dim=-1)
        assert torch.equal(xf.gather(1, ids.long()), top.values)  # ties may pick other ids, never other values
        torch.testing.assert_close(vals, top.values - torch.logsumexp(xf, -1, keepdim=True), atol=2e-5, rtol=0)
        assert all(len(set(r)) == k for r in ids.tolist())
        assert ids[3].tolist() == list(range(k))  # equal values: the lower index first
    alone = ops.score_rows(x[5:6].contiguous(), want[5:6].contiguous(), k)
    assert all(torch.equal(a[0], b[5]) for a, b in zip(alone, (lp, rank, ids, vals)))
    with pytest.raises(RuntimeError, match="outside"):
        ops.score_rows(x, torch.full((37,), V), k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_equal_torch_max_indices(dtype):
    """Greedy's argmax: torch's max(dim=-1).indices, ties to the first, a NaN wins, a row of -inf
    gives 0; V not a multiple of 16 (the tail lanes)."""
    ops, g = load_ops(), torch.Generator().manual_seed(5)
    x = torch.randint(-20, 20, (9, 1000 + 3), generator=g).to(dtype)  # small integers: many ties
    x[3, 1001] = 100                  # the maximum in the tail
    x[4, 7] = float("nan")
    x[4, 500] = float("nan")
    x[5] = float("-inf")
    x[6, 17] = float("inf")
    assert ops.argmax_rows(x).tolist() == x.max(dim=-1).indices.tolist()
    wide = torch.randn(3, 262144, generator=g).to(dtype)  # Gemma 3's vocabulary
    assert ops.argmax_rows(wide).tolist() == wide.max(dim=-1).indices.tolist()
