"""The graph in bf16 on CUDA against the float32 CPU result (HF-verified by test_deepseek_v4).
Writes its numbers to $ZEROINFER_RESULTS_DIR/model_bf16_vs_fp32.json when that is set."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from zeroinfer.model import load
from zeroinfer.model.dummy import DUMMY_CONFIGS

RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def write_results():
    yield
    out = os.environ.get("ZEROINFER_RESULTS_DIR")
    if out and RESULTS:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "model_bf16_vs_fp32.json").write_text(json.dumps(RESULTS, indent=1) + "\n")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(DUMMY_CONFIGS))
def test_bf16_cuda_tracks_fp32_cpu(name, gen):
    ref = load(f"dummy:{name}", seed=3)
    gpu = load(f"dummy:{name}", seed=3, dtype=torch.bfloat16, device="cuda")
    # Three independent 96-token draws, pooled: one bf16 flip of a discrete choice early in a
    # sequence (an indexer top-k, a router) moves every later token of that sequence, so a single
    # draw's median swings with the draw (an H200 run, seed 1468361464: median 0.9983, 78% of
    # tokens over 0.99, where typical draws give 0.9999 and 90-96%); pooled, a flip stays the
    # minority the bounds below allow for.
    draws = [torch.randint(2, ref.config.vocab_size, (96,), generator=gen).tolist()
             for _ in range(3)]
    want = torch.cat([ref.logits(ids) for ids in draws])
    got = torch.cat([gpu.logits(ids).cpu() for ids in draws])
    cos_tok = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    prompt = draws[0][:24]
    g_ref, g_gpu = ref.greedy(prompt, 32), gpu.greedy(prompt, 32)
    agree = next((i for i, (a, b) in enumerate(zip(g_ref, g_gpu)) if a != b), len(g_ref))
    RESULTS[name] = {
        "tokens": len(cos_tok),
        "median_token_cosine": cos_tok.median().item(),
        "fraction_tokens_cosine_gt_0.99": (cos_tok > 0.99).float().mean().item(),
        "min_token_cosine": cos_tok.min().item(),
        "max_abs_err_over_max_abs_logit": ((got - want).abs().max() / want.abs().max()).item(),
        "top1_agreement": top1,
        "greedy_tokens_identical_prefix": agree, "greedy_len": len(g_ref)}
    print(name, RESULTS[name])
    # bf16 tolerance: the typical token matches to bf16 precision; a minority differs because
    # bf16 flips discrete choices (router / indexer top-k), exactly as HF's own bf16 model does
    # against its fp32 one (see test_bf16_deviation_like_hf in test_deepseek_v4.py; numbers below are written by the H200 run).
    assert RESULTS[name]["median_token_cosine"] > 0.999, RESULTS[name]
    assert RESULTS[name]["fraction_tokens_cosine_gt_0.99"] > 0.8, RESULTS[name]
    assert top1 > 0.8, RESULTS[name]
