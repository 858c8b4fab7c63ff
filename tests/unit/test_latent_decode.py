"""Multi-head latent attention's decode kernel (kernels/csrc/latent_attention.cpp) against the torch
form it replaces (attention/torch_ref.py's latent_decode): every head of a sequence over the one
latent head of its blocks, read in place through its table, a key's value its first V values.
Contexts of one key, of a block and one more, across blocks laid out out of order; heads not a
multiple of the kernel's 4; values not a multiple of its 64 (DeepSeek's are 512, the tests' small
models' 32); fewer sequences than threads (heads split across them); and a row's result the same
bits alone as in a batch."""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention.torch_ref import latent_decode
from pagedllm.kernels import load_ops

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def case(n: int, heads: int, d: int, lens: list[int], dtype, bs: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n_ // bs) for n_ in lens) + 3
    cache = torch.randn(blocks, bs, 1, d, generator=g).to(dtype)
    width = max(-(-n_ // bs) for n_ in lens) + 1   # one block more than the longest: padding columns
    perm = torch.randperm(blocks, generator=g)
    tables = torch.stack([perm[(i * width) % (blocks - width):][:width] for i in range(n)]).int().contiguous()
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, d, v, lens", [
    (16, 576, 512, [1, 17, 40, 300]),   # DeepSeek's latent: 512 + 64 rotary
    (6, 48, 32, [16, 3, 33]),           # the tests' models: 32 + 16; 6 heads, values in one vector
    (16, 576, 512, [90]),               # one sequence: its heads split across the threads
])
def test_the_kernel_equals_the_torch_form(dtype, heads, d, v, lens):
    ops = load_ops()
    q, cache, tables, lens_t = case(len(lens), heads, d, lens, dtype)
    out = torch.empty(len(lens), heads, v, dtype=dtype)
    ops.latent_decode(out, q, cache, tables, lens_t, 0.11)
    want = latent_decode(q.float(), cache.float(), tables, lens_t, max(lens), 0.11, v)
    torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_a_row_is_the_same_alone_and_in_a_batch():
    ops = load_ops()
    q, cache, tables, lens = case(5, 16, 576, [7, 64, 129, 2, 250], torch.bfloat16, seed=3)
    batch = torch.empty(5, 16, 512, dtype=torch.bfloat16)
    ops.latent_decode(batch, q, cache, tables, lens, 0.05)
    for i in range(5):
        alone = torch.empty(1, 16, 512, dtype=torch.bfloat16)
        ops.latent_decode(alone, q[i:i + 1], cache, tables[i:i + 1], lens[i:i + 1], 0.05)
        assert torch.equal(alone, batch[i:i + 1]), i


def test_bad_shapes_are_refused_by_name():
    ops = load_ops()
    q, cache, tables, lens = case(2, 4, 48, [5, 9], torch.float32)
    with pytest.raises(RuntimeError, match="D and V must be multiples of 16"):
        ops.latent_decode(torch.empty(2, 4, 40), q, cache, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="sequence 1 has 99 keys"):
        ops.latent_decode(torch.empty(2, 4, 32), q, cache, tables, torch.tensor([5, 99], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="in q's dtype"):
        ops.latent_decode(torch.empty(2, 4, 32), q, cache.bfloat16(), tables, lens, 1.0)
