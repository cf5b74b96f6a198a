"""`zeroinfer bench`: a synthetic decode workload, run with the zero-overhead pipeline on and off
(on a GPU with decode rounds from CUDA graphs, and once more without them, eagerly). Each is
timed on its second pass, so that one-time costs (graph captures, first allocations) stay out.

Per batch size it reports decode throughput, the device's idle time between rounds (CUDA events
around each round on a GPU; the emulated device's clock on CPU), the host's scheduling time per
round, and the KV bytes per token of each cache kind against the layout's theoretical size.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from zeroinfer.engine.engine import EngineConfig, LLMEngine, kv_bytes_per_token
from zeroinfer.engine.runner import ModelRunner
from zeroinfer.model import load
from zeroinfer.sampling_params import SamplingParams
from zeroinfer.testing import bench


def _one(model, batch: int, input_len: int, output_len: int, async_on: bool,
         graphs: bool, kv_cache_dtype: str) -> dict:
    cfg = EngineConfig(max_num_seqs=batch, max_model_len=input_len + output_len + 1,
                       max_num_batched_tokens=max(batch * input_len, batch),
                       async_scheduling=async_on, decode_graphs=graphs,
                       kv_cache_dtype=kv_cache_dtype)
    eng = LLMEngine(model, cfg, seed=0)
    g = torch.Generator().manual_seed(batch)
    V = model.config.vocab_size
    prompts = [torch.randint(2, V, (input_len,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    # The workload once untimed: a CUDA graph is captured on its class's first round, a
    # one-time cost that is not the decode rate. The timed pass repeats it on the warm engine.
    for ids in prompts:
        eng.add_request(ids, params)
    eng.finish()
    eng.runner.timing = True
    eng.history = []
    eng.host_time = dict.fromkeys(eng.host_time, 0.0)
    first_round = eng.rounds
    for ids in prompts:
        eng.add_request(ids, params)
    eng.step()  # the prefill round (its gap to the first decode is not a decode gap)
    t0 = time.perf_counter()
    eng.finish()
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    decode_rounds = eng.history[1:]
    gaps = ModelRunner.idle_gaps(decode_rounds)
    rounds = eng.rounds - first_round
    n = max(1, rounds)
    row = {
        "batch": batch, "async": async_on, "graphs": graphs, "input_len": input_len,
        "output_len": output_len,
        "decode_tokens_per_s": batch * (output_len - 1) / wall,
        "idle_gap_us_median": statistics.median(gaps) * 1e6 if gaps else None,
        "idle_gap_us_mean": statistics.fmean(gaps) * 1e6 if gaps else None,
        "schedule_us_per_round": eng.host_time["schedule"] / n * 1e6,
        "launch_us_per_round": eng.host_time["launch"] / n * 1e6,
        "commit_us_per_round": eng.host_time["commit"] / n * 1e6,
        "rounds": rounds,
    }
    eng.close()
    return row


def kv_layout_rows(model, cfg: EngineConfig) -> list[dict]:
    """Allocated bytes per cached token of each kind vs. the layout's theoretical size."""
    eng = LLMEngine(model, cfg)
    theory = kv_bytes_per_token(model, cfg.kv_cache_dtype)
    caches = eng.runner.caches
    rows = []
    for kind, attr, tokens_per_unit, blocks_attr in (
            ("window", "window", 1, "window_block_size"),
            ("csa", "comp", model.config.csa_rate, "csa_block_size"),
            ("hca", "comp", model.config.hca_rate, "hca_block_size")):
        pools = [c for c in caches if (kind == "window" or c.kind.startswith(
            "compressed" if kind == "csa" else "heavily"))]
        nbytes = sum(getattr(c, attr).numel() * getattr(c, attr).element_size() for c in pools)
        if kind == "csa":
            nbytes += sum(c.index.numel() * c.index.element_size() for c in pools)
        blocks = {"window": eng.spec.num_window_blocks, "csa": eng.spec.num_csa_blocks,
                  "hca": eng.spec.num_hca_blocks}[kind]
        tokens = blocks * getattr(eng.spec, blocks_attr) * tokens_per_unit
        rows.append({"kind": kind, "allocated_bytes": nbytes, "tokens_covered": tokens,
                     "bytes_per_token": nbytes / max(1, tokens),
                     "theoretical_bytes_per_token": theory[kind],
                     "ratio": (nbytes / max(1, tokens)) / theory[kind] if theory[kind] else None})
    eng.close()
    return rows


def run_engine_bench(a) -> None:
    dev = a.device
    if dev == "auto":
        from zeroinfer.llm import _resolve_device

        dev = str(_resolve_device("auto"))
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    model = load(a.model, dtype=dtype, device=dev)
    sizes = [int(s) for s in a.batch_sizes.split(",")]
    rows = []
    cuda = dev.startswith("cuda")
    modes = [(False, cuda), (True, cuda)] + ([(True, False)] if cuda else [])
    for b in sizes:
        for async_on, graphs in modes:
            rows.append(_one(model, b, a.input_len, a.output_len, async_on, graphs,
                             a.kv_cache_dtype))
            print(rows[-1], flush=True)
    cols = ["batch", "async", "graphs", "decode_tokens_per_s", "idle_gap_us_median",
            "idle_gap_us_mean", "schedule_us_per_round", "launch_us_per_round",
            "commit_us_per_round", "rounds"]
    bench.print_table(rows, cols)
    kv = kv_layout_rows(model, EngineConfig(max_num_seqs=8, max_model_len=4096,
                                            kv_cache_dtype=a.kv_cache_dtype))
    bench.print_table(kv, ["kind", "bytes_per_token", "theoretical_bytes_per_token", "ratio"])
    device = "cuda" if dev.startswith("cuda") else "cpu"
    path = bench.write_results("engine", rows, device=device,
                               extra={"model": a.model, "dtype": str(dtype), "kv_layout": kv,
                                      "kv_cache_dtype": a.kv_cache_dtype},
                               out_dir=Path(a.out_dir) if a.out_dir else None)
    print(f"wrote {path}")
