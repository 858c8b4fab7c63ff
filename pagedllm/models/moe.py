"""A mixture of experts in place of a layer's MLP (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral).

A router (one matmul to E scores) picks each token's top k experts; each expert is an MLP of
its own (gate and up, the activation, down); the token's output is the experts' outputs
weighted by their router probabilities (softmax in fp32, renormalized over the k where the
model says so). Qwen2-MoE adds a shared expert every token runs, gated by a sigmoid.

The experts' weights are stacked, w13 [E, 2I, H] (gate over up) and w2 [E, H, I], so a step's
rows are grouped by expert and each expert's matmuls run over its rows only: on the CPU in
one compiled call for the whole layer (kernels/csrc/moe.cpp: no Python loop over experts, and
an expert no row chose costs nothing); elsewhere the same grouping in torch. bf16 experts are
packed once at load for AVX512-BF16's pair dot products (pack_bf16), so one kernel runs a decode
step's few rows at memory speed and a prefill's hundreds in register tiles, where oneDNN
reordered the plain weights on every call (benchmarks/moe.py: the batch 114 -> 122 tok/s).

Quantized (set_blocks): each stack as blocks of its rows, expert after expert (q8_0 or q4_1
made from the float weights, or a GGUF file's own ffn_*_exps blocks, K-quants included), run by
the same compiled call with quant_linear.cpp's block kernels on each expert in place. The
router stays float, as llama.cpp keeps ffn_gate_inp: its scores pick the experts."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.chooser import Candidate, Verdict, chooser
from .config import ModelConfig
from .mlp import MLP
from .prepack import PANEL, from_panels, panels_shape, to_panels
from .quantization import FORMAT_IDS, Blocks, RawBlocks, pack, quantize_q4_1, quantize_q8_0, unpack


# The compiled experts' activations by name (kernels/csrc/moe.cpp ActKind)
ACT_IDS = {"gelu_tanh": 0, "silu": 1, "swiglu_oai": 2}


def to_slabs(w: torch.Tensor, group: int) -> torch.Tensor:
    """[E, N, K] as the packed kernels read it (moe.cpp: slabs of 16 output columns, each slab's K in
    runs of `group`: 2 bf16 for vdpbf16ps, 4 int8 for vpdpbusd), the same shape, another order."""
    e, n, k = w.shape
    return w.view(e, n // 16, 16, k // group, group).permute(0, 1, 3, 2, 4).contiguous().view(e, n, k)


def from_slabs(w: torch.Tensor, group: int) -> torch.Tensor:
    """One expert's [N, K] back from to_slabs' order."""
    n, k = w.shape
    return w.view(n // 16, k // group, 16, group).permute(0, 2, 1, 3).reshape(n, k)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.moe
        self.num_experts, self.top_k, self.norm_topk = m.num_experts, m.top_k, m.norm_topk
        self.routing = m
        self.gate = nn.Linear(cfg.hidden_size, m.num_experts, bias=m.router_bias)   # the router
        self.gate.router = True   # read by moe_route as it is (prepack.py leaves it plain)
        if m.choice_bias:   # DeepSeek-V3's: added to the scores that pick, not to the weights
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(m.num_experts))
        # The experts this module holds: first_expert.. of the router's (expert parallelism: a rank's
        # share; the decoder sets first_expert by rank), each whole or a shard of its columns.
        self.local_experts, self.first_expert = m.local_experts, 0
        self.width, self.hidden = m.width, cfg.hidden_size
        if m.blocks:   # the checkpoint's blocks arrive at load (set_blocks): no float stacks, even empty ones
            self.w13 = self.w2 = None
        else:
            self.w13 = nn.Parameter(torch.empty(m.local_experts, 2 * m.width, cfg.hidden_size), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(m.local_experts, cfg.hidden_size, m.width), requires_grad=False)
        if m.expert_bias:   # gpt-oss: each expert's gate|up bias [2I] and down bias [H]
            self.w13_bias = nn.Parameter(torch.empty(m.local_experts, 2 * m.width), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(m.local_experts, cfg.hidden_size), requires_grad=False)
        else:
            self.w13_bias = self.w2_bias = None
        self.packed = False   # w13 / w2 in the layout of vdpbf16ps (pack_bf16)
        self.interleaved = False   # MXFP4 blocks repacked for the int8 outer-product kernel (interleave_mxfp4)
        self.w8a8 = False     # int8 experts with int8 activations (set_w8a8)
        self.activation = cfg.activation
        if m.shared_width:
            self.shared_expert = MLP(cfg, m.shared_width)
            if m.shared_gated:
                self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    @property
    def quantized(self) -> bool:
        return self.w13 is None

    def set_blocks(self, w13: Blocks | RawBlocks, w2: Blocks | RawBlocks) -> None:
        """The experts' weights as blocks in place of the float stacks: w13 the rows of every
        expert's gate then up [E 2I, H], w2 its down's [E H, I] (ValueError on other shapes)."""
        e, two_i, hid = self.local_experts, 2 * self.width, self.hidden
        args = []
        for name, b, want in (("w13", w13, (e * two_i, hid)), ("w2", w2, (e * hid, two_i // 2))):
            if tuple(b.shape) != want:
                raise ValueError(f"{name} blocks of shape {tuple(b.shape)} for {e} experts of [{want[0] // e}, "
                                 f"{want[1]}]")
            parts = [t.reshape(e, -1, *t.shape[1:]) for t in pack(b)]
            for i, t in enumerate(parts):
                self.register_buffer(f"{name}_blocks{i}", t, persistent=False)
            setattr(self, f"{name}_format", b.fmt)
            args += [FORMAT_IDS[b.fmt], parts]
        self.w13 = self.w2 = None
        # the kernel's arguments, read every step: a plain attribute, not five lookups of buffers
        self._block_args = (*args, self.width)

    def set_w8a8(self) -> None:
        """W8A8 experts (models/w8a8.py's arithmetic): int8 weights with a scale per output channel,
        packed for VNNI (to_slabs, runs of 4) with each channel's sum of codes; the activations are
        quantized per row as the kernel runs (moe.cpp moe_experts_w8a8)."""
        from .w8a8 import quantize_weight

        args = []
        for name in ("w13", "w2"):
            w = getattr(self, name)
            e, n, k = w.shape
            if n % 16 or k % 16:
                raise ValueError(f"w8a8 experts need N and K multiples of 16, got {name} [{e}, {n}, {k}]")
            q, s = quantize_weight(w.reshape(e * n, k))
            q = q.view(e, n, k)
            parts = [to_slabs(q, 4), s.view(e, n).contiguous(), q.sum(-1, dtype=torch.int32)]
            for i, t in enumerate(parts):
                self.register_buffer(f"{name}_w8{i}", t, persistent=False)
            args.append(parts)
        self.w13 = self.w2 = None
        self.w8a8 = True
        self._w8_args = tuple(args)

    def w8a8_args(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """moe_experts_w8a8's weight arguments: [codes, scales, column sums] of w13 and of w2."""
        return self._w8_args

    def inputs(self, rows: torch.Tensor) -> torch.Tensor:
        """A matmul's input rows as the experts' arithmetic sees them: W8A8 quantizes each row to int8
        codes and a scale (the torch path's stand-in for the kernel's integer sums)."""
        if not self.w8a8:
            return rows
        from .w8a8 import quantize_rows

        q, s = quantize_rows(rows)
        return (q.float() * s[:, None]).to(rows.dtype)

    def block_args(self) -> tuple:
        """moe_experts_blocks' weight arguments: (type13, [w13 parts], type2, [w2 parts], width)."""
        return self._block_args

    def can_pack(self) -> bool:
        """Whether pack_bf16 applies: float bf16 experts of whole 32-column panels and K pairs."""
        return not self.quantized and not self.packed and self.w13.dtype == torch.bfloat16 \
            and self.w13.shape[1] % PANEL == 0 and self.w2.shape[1] % PANEL == 0 and self.w13.shape[2] % 2 == 0 \
            and self.w2.shape[2] % 2 == 0

    def pack_bf16(self) -> None:
        """The bf16 experts reordered once in panels for the vdpbf16ps kernel (bf16_panels.h), in place:
        the same shape, another order."""
        for p in (self.w13, self.w2):
            p.data = to_panels(p.data).view(p.shape)
        self.packed = True

    def can_interleave(self) -> bool:
        """Whether interleave_mxfp4 applies: MXFP4 blocks whose matrices have rows in sixteens."""
        return self.quantized and not self.w8a8 and not self.interleaved \
            and getattr(self, "w13_format", None) == getattr(self, "w2_format", None) == "MXFP4" \
            and (2 * self.width) % IL_ROWS == 0 and self.hidden % IL_ROWS == 0

    def interleave_mxfp4(self, kernels) -> None:
        """The MXFP4 experts' bytes repacked once (kernels' mxfp4_interleave) for the int8 outer-
        product kernel: the same bytes in another order, 16 rows' codes side by side."""
        _, p13, _, p2, width = self._block_args
        parts = []
        for name, (raw,) in (("w13", p13), ("w2", p2)):
            il = kernels.mxfp4_interleave(raw.reshape(-1, raw.shape[-1])).view(raw.shape)
            self.register_buffer(f"{name}_blocks0", il, persistent=False)
            parts.append([il])
        self._block_args = (MXFP4_IL, parts[0], MXFP4_IL, parts[1], width)
        self.interleaved = True

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (w13 [2I, H], w2 [H, I]) in dtype: its blocks unpacked where quantized, its
        pairs put back where packed."""
        if self.w8a8:
            return tuple((from_slabs(q[e], 4).float() * s[e][:, None]).to(dtype) for q, s, _ in self._w8_args)
        if self.packed:
            return tuple(from_panels(w[e].view(panels_shape(*w.shape[1:])), w.shape[1]) for w in (self.w13, self.w2))
        if not self.quantized:
            return self.w13[e], self.w2[e]
        _, p13, _, p2, width = self.block_args()
        if self.interleaved:
            p13, p2 = [deinterleave_mxfp4(p13[0])], [deinterleave_mxfp4(p2[0])]
        return (unpack(self.w13_format, [t[e] for t in p13], self.hidden).dequantize().to(dtype),
                unpack(self.w2_format, [t[e] for t in p2], width).dequantize().to(dtype))

    def route(self, x: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, experts [T, k] int64) of each row, as transformers computes them: one
        compiled call on the CPU (moe_route), these steps elsewhere."""
        if not self.routing.plain_router:
            return self._route_grouped(x)
        if ops.fused(x) and x.dtype in (torch.bfloat16, torch.float32) and self.gate.weight is not None:
            return ops.k.moe_route(x.contiguous(), self.gate.weight, self.top_k, self.norm_topk)
        probs = torch.softmax(ops.linear(self.gate, x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def act_args(self) -> tuple:
        """The compiled experts' (b13, b2, alpha, limit): gpt-oss's biases and its SwiGLU's constants."""
        m = self.routing
        return self.w13_bias, self.w2_bias, m.swiglu_alpha, m.swiglu_limit

    def activate(self, gate_up: torch.Tensor, act_mul) -> torch.Tensor:
        """The experts' activation of [gate | up] rows: act_mul's (silu or GELU-tanh times up), or
        gpt-oss's clamped SwiGLU, (clamp(up, -l, l) + 1) * g * sigmoid(alpha g), g = min(gate, l)."""
        if self.activation != "swiglu_oai":
            return act_mul(gate_up, self.activation)
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.routing.swiglu_limit)
        return (up.clamp(-self.routing.swiglu_limit, self.routing.swiglu_limit) + 1) * gate * \
            torch.sigmoid(gate * self.routing.swiglu_alpha)

    def _route_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek's and gpt-oss's routers, as transformers computes them (fp32 scores of an fp32 matmul, the bias added):
        softmax or sigmoid scores; the experts picked by the scores plus the choice bias, within
        the best topk_group groups (a group's score: its best expert's, with a bias its best two's
        sum); their weights the unbiased scores, renormalized where norm_topk, times routed_scaling."""
        m = self.routing
        bias = self.gate.bias.float() if self.gate.bias is not None else None
        scores = torch.nn.functional.linear(x.float(), self.gate.weight.float(), bias)
        scores = scores.sigmoid() if m.scoring == "sigmoid" else scores.softmax(dim=-1)
        choice = scores + self.gate.e_score_correction_bias.float() if m.choice_bias else scores
        if m.groups > 1:
            grouped = choice.view(-1, m.groups, m.num_experts // m.groups)
            best = grouped.topk(2, dim=-1)[0].sum(dim=-1) if m.choice_bias else grouped.amax(dim=-1)
            kept = torch.zeros_like(best).scatter_(1, best.topk(m.topk_group, dim=-1)[1], 1.0)
            # outside the kept groups: never picked (a bias-free softmax's zeros, as transformers masks them)
            hidden = ~kept.bool().repeat_interleave(m.num_experts // m.groups, dim=1)
            choice = choice.masked_fill(hidden, float("-inf") if m.choice_bias else 0.0)
        experts = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * m.routed_scaling, experts

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        weights, experts = self.route(x, ops)
        out = ops.experts(self, x, weights, experts)
        if hasattr(self, "shared_expert_gate"):
            out += torch.sigmoid(ops.linear(self.shared_expert_gate, x)) * self.shared_expert(x, ops)
        elif hasattr(self, "shared_expert"):
            out += self.shared_expert(x, ops)
        return out


def experts_verdict(moe: SparseMoE, kernels) -> Verdict:
    """Whether a bf16 mixture's experts run faster packed in panels (vdpbf16ps, pack_bf16) or plain
    (a few rows: the kernel's own dot products; more: torch's matmul, oneDNN's, on AMX where the CPU
    has it), timed on this machine over random routings of its shape. One path for every row
    count: packing is in place, and two copies of every expert would double the model."""
    e, n2, h = moe.w13.shape
    width, k, act = moe.w2.shape[2], moe.top_k, ACT_IDS[moe.activation]
    routes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def run(packed: bool):
        def go(w, x):
            m = x.shape[0]
            if m not in routes:   # the same random top-k routing for both paths
                scores = torch.rand(m, e, generator=torch.Generator().manual_seed(m))
                weights, experts = torch.softmax(scores, dim=-1).topk(k, dim=-1)
                routes[m] = (weights.float().contiguous(), experts.contiguous())
            kernels.moe_experts(torch.empty_like(x), x, w[0], w[1], *routes[m], act, 0, e, packed)
        return go

    def panels(w):
        return tuple(to_panels(t).view(t.shape) for t in w)

    def weight(g: torch.Generator):
        return tuple((torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16) for s in ((e, n2, h), (e, h, width)))

    cands = [Candidate("panels", panels, run(True)), Candidate("plain", lambda w: w, run(False))]
    return chooser().choose(f"moe-experts-top{k}", (e, n2, h), 2 * k * (n2 * h + h * width), cands, weight,
                            2 * e * (n2 * h + h * width), lambda m: torch.randn(m, h).to(torch.bfloat16),
                            gain=math.inf, sources=("moe.cpp",))


def experts_torch(moe: SparseMoE, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                  act_mul) -> torch.Tensor:
    """The experts over their rows in torch (where the compiled kernel does not run): rows
    grouped by expert once, a loop over the experts some row chose."""
    t, k = experts.shape
    flat = experts.reshape(-1) - moe.first_expert
    flat = flat.masked_fill((flat < 0) | (flat >= moe.local_experts), moe.local_experts)  # other ranks': last
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=moe.local_experts + 1).tolist()[:moe.local_experts]
    rows = order // k
    out = torch.zeros_like(x, dtype=torch.float32)
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        idx = rows[start:start + n]
        w13, w2 = moe.expert_weights(e, x.dtype)
        b13, b2 = (None, None) if moe.w13_bias is None else (moe.w13_bias[e], moe.w2_bias[e])
        h = moe.activate(F.linear(moe.inputs(x[idx]), w13, b13), act_mul)
        y = F.linear(moe.inputs(h), w2, b2).float() * weights.reshape(-1)[order[start:start + n]].unsqueeze(1)
        out.index_add_(0, idx, y)
        start += n
    return out.to(x.dtype)


def quantize_experts(model: nn.Module, method: str) -> int:
    """Every mixture's experts quantized from their float weights as the dense matmuls are: "int8"
    q8_0 blocks, "int4" q4_1 blocks, "w8a8" int8 weights and activations. Returns how many layers
    of experts were quantized."""
    make = quantize_q4_1 if method == "int4" else quantize_q8_0
    n = 0
    for mod in model.modules():
        if isinstance(mod, SparseMoE) and not mod.quantized:
            if method == "w8a8":
                mod.set_w8a8()
            else:
                mod.set_blocks(make(mod.w13.reshape(-1, mod.w13.shape[-1])), make(mod.w2.reshape(-1, mod.w2.shape[-1])))
            n += 1
    return n


IL_ROWS = 16                 # rows of W whose codes the repacked MXFP4 keeps side by side
IL_BYTES = IL_ROWS + 4 * 64  # a group's block: its rows' exponents, then 4 units of 64 bytes of codes
MXFP4_IL = 1039              # the kernels' id of repacked MXFP4 (blocks.h BLOCKS_MXFP4_IL)


def deinterleave_mxfp4(il: torch.Tensor) -> torch.Tensor:
    """Repacked MXFP4 [..., R, K/32 * 17] (R a multiple of 16) back in ggml's block order: per 16
    rows and block, 16 exponents, then 4 units of 64 bytes, byte 4c + i of unit s holding row c's
    codes of k = 8s + i (low nibble) and 8s + 4 + i (high)."""
    *lead, rows, row_bytes = il.shape
    nblk = row_bytes // 17
    t = il.reshape(-1, nblk, IL_BYTES)
    exps = t[..., :IL_ROWS]                                      # [G, nblk, c]
    units = t[..., IL_ROWS:].reshape(-1, nblk, 4, IL_ROWS, 4)    # [G, nblk, s, c, i]
    codes = torch.stack([units & 15, units >> 4], dim=-2)        # [G, nblk, s, c, half, i]: k = 8s + 4 half + i
    codes = codes.permute(0, 1, 3, 2, 4, 5).reshape(-1, nblk, 16, 32)
    blocks = torch.cat([exps.unsqueeze(-1), codes[..., :16] | (codes[..., 16:] << 4)], dim=-1)   # [G, nblk, c, 17]
    return blocks.permute(0, 2, 1, 3).reshape(*lead, rows, row_bytes).contiguous()


def interleave_experts(model: nn.Module, kernels) -> int:
    """Every mixture's MXFP4 experts repacked for the int8 outer-product kernel (interleave_mxfp4),
    once at load, where the kernels were built with AVX512-VNNI. Returns how many stacks."""
    if kernels is None or not kernels.moe_can_w8a8():
        return 0
    n = 0
    for moe in model.modules():
        if isinstance(moe, SparseMoE) and moe.can_interleave():
            moe.interleave_mxfp4(kernels)
            n += 2
    return n


def pack_experts(model: nn.Module, kernels) -> int:
    """Every bf16 mixture's experts packed for vdpbf16ps (pack_bf16), once at load, where the
    chooser times that faster than the plain weights here. Returns how many weights were packed."""
    if kernels is None or not kernels.moe_can_pack():
        return 0
    n = 0
    for moe in model.modules():
        if isinstance(moe, SparseMoE) and moe.can_pack() and moe.w13.device.type == "cpu" \
                and experts_verdict(moe, kernels).route.paths == ("panels",):
            moe.pack_bf16()
            n += 2
    return n
