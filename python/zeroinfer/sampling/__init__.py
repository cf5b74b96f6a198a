"""Token sampling: `sample(logits, SamplingBatch)`; see zeroinfer.sampling.sampler."""

from __future__ import annotations

from zeroinfer.sampling.sampler import (
    SampleResult,
    SamplingBatch,
    random_bits,
    sample,
    uniforms,
)

__all__ = ["SampleResult", "SamplingBatch", "random_bits", "sample", "uniforms"]
