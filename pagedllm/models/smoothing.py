"""SmoothQuant for W8A8 (Xiao et al., 2023): a few input channels of every matmul carry
activations tens of times larger than the rest, and a per-token int8 scale sized for them
rounds the others away. Dividing channel j of the activations by s_j and multiplying
column j of the weight by s_j leaves the product unchanged and moves the outliers into
the weight, which is quantized per output channel and takes them well:

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

The division is folded into what makes the activation, so it costs nothing at run time:
the RMSNorm weights (inputs of q/k/v, gate/up and the LM head), the up rows of gate/up
(input of down: silu(g) * (u / s) = (silu(g) * u) / s) and the v rows of q/k/v (input of
o: a v channel feeds the same channel of every query head of its group, so a group shares
its scale). max|X_j| comes from one prefill of a fixed calibration text through the float
model (no data beyond the package). Measured on SmolLM2-135M (bf16 weights), perplexity of
the fixed text (bench/quality.py) at 1,000 / 256 tokens: bf16 6.520 / 8.342; W8A8 without
smoothing 6.759 / 8.765 (+3.7 / +5.1 %); smoothed with alpha 0.3 / 0.4 / 0.5 / 0.6 / 0.7 /
0.8: +2.7 / +1.9 / +1.2 / +1.7 / +2.9 / +4.1 % at 1,000 tokens (+2.8 / +1.7 / +2.7 / +3.6 /
+5.3 / +4.1 % at 256, the noisier figure). Keeping the LM head in bf16 changes little
(alpha 0.5: +1.1 %), so it is quantized too."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

ALPHA = 0.5

# Prose, code, a chat turn, lists, numbers and a few scripts: the kinds of token whose
# activations set the channels' maxima. Not the text perplexity is measured on.
CALIBRATION_TEXT = """The committee met on Tuesday to review the budget. After a long discussion, the members agreed to \
fund the new library wing, but they postponed the decision on the park until the spring.
def merge(a, b):
    out = []
    while a and b:
        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))
    return out + a + b
User: Can you explain why the sky is blue?
Assistant: Sunlight is scattered by the molecules in the air, and blue light, with its shorter wavelength, is \
scattered the most. In short: 1. Rayleigh scattering; 2. wavelength; 3. perception.
{"name": "Ada", "age": 36, "skills": ["math", "poetry"]}
Il était une fois une petite ville au bord de la mer. 東京は日本の首都です。 Prices rose 3.5% in 2023; analysts \
expect $1,200 by Q4. SELECT id, total FROM orders WHERE total > 100 ORDER BY total DESC;"""


def input_maxima(model: nn.Module, run: Callable[[], None]) -> dict[str, torch.Tensor]:
    """max |x_j| over the tokens of `run()` of each nn.Linear's input channel j, fp32, by module name."""
    seen: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(_mod, args) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float()
            seen[name] = torch.maximum(seen[name], x) if name in seen else x
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


def _column_max(w: torch.Tensor) -> torch.Tensor:
    return w.detach().float().abs().amax(0)


def _scales(xmax: torch.Tensor, wmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), kept away from 0."""
    return (xmax.clamp(min=1e-5) ** alpha / wmax.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)


def _fold(norm_or_rows: torch.Tensor, layer_w: torch.Tensor, s: torch.Tensor) -> None:
    """norm_or_rows /= s along its last use (channels), layer_w's columns *= s."""
    norm_or_rows.div_(s.to(norm_or_rows.dtype).reshape(-1, *([1] * (norm_or_rows.dim() - 1))))
    layer_w.mul_(s.to(layer_w.dtype))


@torch.no_grad()
def smooth(model: nn.Module, maxima: dict[str, torch.Tensor], alpha: float = ALPHA) -> int:
    """Fold SmoothQuant's scales into a decoder (models/decoder.py) in place.
    An LM head tied to the embedding gets its own (scaled) weight; the embedding keeps
    its own. Returns how many matmuls were smoothed."""
    n = 0
    for i, layer in enumerate(model.layers):
        attn, mlp, p = layer.self_attn, layer.mlp, f"layers.{i}."
        qkv = attn.qkv_proj
        folds = [(layer.input_layernorm.weight, qkv, "self_attn.qkv_proj")]
        if hasattr(mlp, "gate_up_proj"):   # a mixture's experts and router share the norm: left unsmoothed
            gate_up, down = mlp.gate_up_proj, mlp.down_proj
            folds += [(layer.post_attention_layernorm.weight, gate_up, "mlp.gate_up_proj"),
                      (gate_up.weight[down.in_features:], down, "mlp.down_proj")]
        for norm_or_rows, lin, name in folds:
            _fold(norm_or_rows, lin.weight, _scales(maxima[p + name], _column_max(lin.weight), alpha))
        # o's input channel (head h, dim d) is v's channel (group of h, d): one scale per group's channel.
        heads, groups, d = attn.h, attn.kvh, attn.d  # this rank's heads
        grouped = (groups, heads // groups, d)
        s = _scales(maxima[p + "self_attn.o_proj"].reshape(grouped).amax(1),
                    _column_max(attn.o_proj.weight).reshape(grouped).amax(1), alpha).reshape(-1)
        v0 = (heads + groups) * d
        qkv.weight[v0:].div_(s.to(qkv.weight.dtype)[:, None])
        if qkv.bias is not None:
            qkv.bias[v0:].div_(s.to(qkv.bias.dtype))
        attn.o_proj.weight.mul_(s.to(attn.o_proj.weight.dtype).reshape(groups, 1, d).expand(groups, heads // groups, d)
                                .reshape(-1))
        n += len(folds) + 1
    head = model.lm_head
    s = _scales(maxima["lm_head"], _column_max(head.weight), alpha)
    head.weight = nn.Parameter(head.weight.detach() * s.to(head.weight.dtype), requires_grad=False)  # unties it
    model.norm.weight.div_(s.to(model.norm.weight.dtype))
    return n + 1
