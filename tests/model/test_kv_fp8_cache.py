"""K=V caches in the V4 FP8 layout (CacheSpec.kv_fp8): what the model writes there is exactly
the quantization of what it writes to a float cache, and its logits track the float cache's
within FP8's rounding; the engine sizes its pools by the layout's 584 bytes a vector."""

from __future__ import annotations

import pytest
import torch

from zeroinfer.engine.engine import EngineConfig, LLMEngine, cache_spec, kv_bytes_per_token
from zeroinfer.model import load
from zeroinfer.quant.kv_fp8 import BYTES_PER_TOKEN, dequantize_kv_fp8, quantize_kv_fp8
from zeroinfer.sampling_params import SamplingParams


def _drive(model, gen, device, steps=12, **kw):
    """A float-cache runner and an FP8-cache one over the same prompts (3 sequences) and
    decode steps (the float runner's greedy tokens); returns both and their logits."""
    V = model.config.vocab_size
    runners = [model.runner(max_seqs=3, max_len=64, **kw),
               model.runner(max_seqs=3, max_len=64, kv_fp8=True, **kw)]
    feeds = {s: torch.randint(0, V, (int(torch.randint(5, 40, (1,), generator=gen)),),
                              generator=gen).tolist() for s in range(3)}
    out = [[], []]
    for _ in range(steps + 1):
        logits = [r.step(feeds) for r in runners]
        for k in range(2):
            out[k] += [logits[k][s].to(device) for s in feeds]
        feeds = {s: [int(logits[0][s][-1].argmax())] for s in feeds}
    return runners, [torch.cat(o) for o in out]


@pytest.mark.parametrize("name", ["tiny", "tiny-yarn"])
def test_fp8_cache_holds_the_quantized_vectors(name, gen):
    """Layer 0 sees the same input either way, so its FP8 pools must hold exactly the
    quantization of the float pools (window, and compressed entries where it has them), slot
    for slot; the logits of the whole model stay close."""
    model = load(f"dummy:{name}", seed=int(torch.randint(0, 1000, (1,), generator=gen)))
    (flt, fp8), (a, b) = _drive(model, gen, "cpu")
    c_flt, c_fp8 = flt.caches[0], fp8.caches[0]
    pools = [(c_flt.window, c_fp8.window)] + ([(c_flt.comp, c_fp8.comp)] if c_flt.comp is not None
                                              else [])
    for p_flt, p_fp8 in pools:
        assert p_fp8.dtype == torch.uint8
        assert p_fp8.shape[1] == p_flt.shape[1] * BYTES_PER_TOKEN
        want = dequantize_kv_fp8(quantize_kv_fp8(p_flt[:-1]))
        assert torch.equal(dequantize_kv_fp8(p_fp8[:-1]), want)
        assert want.abs().sum() > 0  # (something was written)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    # (FP8's rounding moves the odd discrete choice - a router's or the indexer's top-k - so a
    # few rows part more; the top-1 token of a random 129k vocabulary is too near-tied to count)
    assert cos.median() > 0.995 and torch.quantile(cos, 0.25) > 0.99, cos


def test_engine_sizes_fp8_pools_by_their_bytes():
    model = load("dummy:tiny", seed=0)
    budget = 1 << 20
    auto = cache_spec(model, EngineConfig(kv_cache_bytes=budget))
    fp8 = cache_spec(model, EngineConfig(kv_cache_bytes=budget, kv_cache_dtype="fp8"))
    per = kv_bytes_per_token(model, "fp8")
    assert per["window"] == model.config.num_hidden_layers * BYTES_PER_TOKEN
    # float32 vectors take 2048 bytes, FP8 584: ~3.5x the tokens for the same bytes
    assert fp8.kv_fp8 and not auto.kv_fp8
    assert fp8.num_window_blocks > 3 * auto.num_window_blocks
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="decode_graphs"):
        EngineConfig(decode_graphs="yes")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_fp8_cache_serves(async_scheduling, gen):
    """The engine on FP8 caches: greedy equals the FP8 runner's greedy (the same numerics),
    every block comes back."""
    model = load("dummy:tiny-yarn", seed=int(torch.randint(0, 1000, (1,), generator=gen)))
    ids = torch.randint(2, model.config.vocab_size, (23,), generator=gen).tolist()
    eng = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=64,
                                        kv_cache_dtype="fp8", async_scheduling=async_scheduling,
                                        max_num_batched_tokens=int(torch.randint(8, 64, (1,),
                                                                                 generator=gen))))
    req = eng.add_request(ids, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    eng.finish()
    assert eng.blocks.all_free()
    eng.close()
    r = model.runner(max_seqs=1, max_len=64, kv_fp8=True)
    nxt = int(r.step({0: ids})[0][-1].argmax())
    want = [nxt]
    while len(want) < 10:
        nxt = int(r.step({0: [nxt]})[0][-1].argmax())
        want.append(nxt)
    assert req.output_ids == want


@pytest.mark.gpu
def test_cuda_fp8_cache_tracks_bf16_cache(gen):
    """On CUDA (bf16 model, the attention kernel reading the FP8 layout), eager and from CUDA
    graphs: close to the bf16 cache's logits."""
    model = load("dummy:tiny-yarn", dtype=torch.bfloat16, device="cuda",
                 seed=int(torch.randint(0, 1000, (1,), generator=gen)))
    for graphs in (False, True):
        _, (a, b) = _drive(model, gen, "cuda", decode_graphs=graphs)
        cos = torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
        assert cos.median() > 0.99, (graphs, cos)
