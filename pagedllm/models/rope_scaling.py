"""YaRN's magnitude scale, plain math (no torch): rope.py's attention factor of the cos/sin tables,
and a family's softmax scale (DeepSeek's mscale(mscale_all_dim)^2, families/deepseek.py)."""
from __future__ import annotations

import math


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
