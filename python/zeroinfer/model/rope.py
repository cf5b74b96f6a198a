"""V4 RoPE: interleaved pairs (2i, 2i+1) on the LAST r channels of each 512-dim vector.

Two tables: `main` (theta=1e4, sliding-only layers) and `compress` (theta=1.6e5 plus optional
YaRN, used by CSA/HCA layers for their own q/kv, their compressors and the indexer). Following HF:
angles in float32, cos/sin cast to the activation dtype, rotation computed in float32.
YaRN's attention factor multiplies cos/sin; it is 1.0 for V4 (see YarnScaling).
"""

from __future__ import annotations

import math

import torch

from zeroinfer import ops
from zeroinfer.model.config import ModelConfig, YarnScaling


def inv_freq(theta: float, dim: int, yarn: YarnScaling | None = None) -> torch.Tensor:
    """One frequency per interleaved pair: [dim/2] float32."""
    exps = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    base = theta**exps
    freq = 1.0 / base
    if yarn is None:
        return freq

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp, as HF does
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    interp = 1.0 / (yarn.factor * base)
    return interp * ramp + freq * (1 - ramp)


class RopeTables:
    """inv_freq of both tables for one model, on one device."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        r = config.qk_rope_head_dim
        self.main = inv_freq(config.rope_theta, r).to(device)
        self.compress = inv_freq(config.compress_rope_theta, r, config.compress_yarn).to(device)
        y = config.compress_yarn
        self.scaling = {"main": 1.0, "compress": y.attention_factor if y else 1.0}

    def cos_sin(self, table: str, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float()[:, None] * getattr(self, table)[None, :]
        s = self.scaling[table]
        return (freqs.cos() * s).to(dtype), (freqs.sin() * s).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
               inverse: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] channels of x [T, ..., d] in interleaved pairs, in
    float32 with one rounding a product and a sum (HF's bits; inverse: by -angle). cos/sin:
    [T, r/2]; they broadcast over the middle (head) dims. `out`: where to write (x's shape)."""
    return ops.rope_rotate(x if x.is_contiguous() else x.contiguous(), cos, sin, inverse=inverse,
                           out=out)
