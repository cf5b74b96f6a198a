"""Speculative decoding in the engine: decode throughput with verification rounds against plain
decoding, on the dummy model.

  python bench/bench_speculative.py [--device cuda] [--batch-sizes 1,8,32] [--drafts 2,4]

Rows per batch size:
  plain      the engine without drafts (zero-overhead pipeline; decode graphs on CUDA): the
             baseline;
  ngram      n-gram (prompt lookup) drafts. A random-weight model's text does not repeat its
             context, so they are seldom accepted: this row is the cost of drafting and of
             verification rounds that gain nothing;
  mtp        drafts from the model's MTP module (its greedy chain, run on the device after
             every round's draws). The dummy module's weights are random, so its drafts are
             seldom right: this row is the module's cost (its pass over every round's tokens
             and its chain of d - 1 steps) with verification rounds that gain little;
  oracle@a   drafts from plain decoding's own output, each right with probability a
             (zeroinfer.testing.drafts.FutureDrafter): the engine's speculative path at a
             known acceptance rate, as a real drafter would drive it.
Every row's tokens are checked against plain decoding's (speculation changes how many tokens
a round yields, never which).

The roofline of a speculative row is plain decoding's rate times its tokens per round: a
verification round of small batches reads the same weights as a decode round, so at best it
costs the same and yields `tokens_per_round` tokens a row. `fraction_of_ideal` = measured rate
/ that; below 1 are the verification round's extra cost (its q tokens a row through attention,
the MoE and the LM head, the draws at every position) and, here, the synchronous rounds'
host time, which the zero-overhead plain baseline hides (`schedule_us_per_round`: the
scheduler and drafter; `launch_us_per_round`: building and enqueueing the round, which also
blocks while the device's queue is full). `graph_captures`: CUDA graphs the timed passes still
had to capture (see _pass; `captured_classes` names them, `warmup_passes` counts the untimed
passes before them); a row with any carries their cost. A row's time is the median of
TIMED_PASSES passes, `pass_spread` their slowest / fastest.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from zeroinfer.engine.engine import EngineConfig, LLMEngine
from zeroinfer.engine.speculative import SpeculativeConfig
from zeroinfer.model import load
from zeroinfer.model.decode_graph import captured_classes, graph_captures
from zeroinfer.sampling_params import SamplingParams
from zeroinfer.testing import bench
from zeroinfer.testing.drafts import FutureDrafter, draft_on_device_by_slot

MODEL = "dummy"


MAX_WARMUPS = 4  # untimed passes before the timed ones, at most
# timed passes a row, its time their median: on a GPU the host's share of a small batch's round
# moves by tens of percent between passes (one batch-8 plain pass ran 1.4x another)
TIMED_PASSES = 3


def _pass(model, prompts, params, spec, drafter, futures, seed, graphs=None
          ) -> tuple[float, list, LLMEngine]:
    """TIMED_PASSES timed passes of the workload on a fresh engine after untimed ones: returns
    (their median decode seconds, outputs, engine). CUDA graphs are captured on a class's first
    use (rows, tokens a row, widths), and a speculative pass's classes depend on its drafts (the
    first pass's prompt round drafts by n-gram lookup, before the device drafter is in), so
    untimed passes repeat until one captures nothing (at most MAX_WARMUPS);
    `eng.timed_captures` names any capture the timed passes still made (each synchronises and
    takes milliseconds), `eng.pass_spread` is their slowest / fastest. Every pass draws the
    host drafter's right and wrong drafts from the same seed."""
    b = len(prompts)
    cfg = EngineConfig(max_num_seqs=b, max_model_len=len(prompts[0]) + params.max_tokens + 16,
                       max_num_batched_tokens=b * len(prompts[0]), speculative=spec,
                       decode_graphs=graphs)
    eng = LLMEngine(model, cfg, seed=0)
    right = float(drafter.split("@")[1]) if drafter.startswith("oracle") else None

    def one(timed: bool) -> tuple[float, list, int]:
        rng = random.Random(seed)
        reqs = [eng.add_request(p, params) for p in prompts]
        if right is not None:  # (the host's drafter, for synchronous rounds)
            for r, f in zip(reqs, futures):
                r.drafter = FutureDrafter(f, rng, 1 - right, model.config.vocab_size, full=True)
        eng.step()  # the prefill round (every prompt admitted: the slots are known now)
        if right is not None and eng.spec_pipelined:  # (the device's, for pipelined rounds)
            draft_on_device_by_slot(eng, {r.slot: r.prompt_ids + f for r, f in zip(reqs, futures)},
                                    1 - right, seed=len(prompts))
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        if timed:
            eng.scheduler.num_drafted = eng.scheduler.num_accepted = 0
            eng.scheduler.num_pipelined = 0
            eng.host_time = dict.fromkeys(eng.host_time, 0.0)
        rounds0 = eng.rounds  # (the prefill round above is not timed: not counted either)
        t0 = time.perf_counter()
        eng.finish()
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, [r.output_ids for r in reqs], eng.rounds - rounds0

    eng.warmups = 0
    while eng.warmups < MAX_WARMUPS:
        captures0 = graph_captures()
        one(timed=False)
        eng.warmups += 1
        if graph_captures() == captures0:
            break
    captures0, walls, outs = graph_captures(), [], []
    for _ in range(TIMED_PASSES):  # (the counters read after are the last pass's)
        wall, out, eng.timed_rounds = one(timed=True)
        walls.append(wall)
        outs.append(out)
    # (a pass whose tokens differ from the first's is the one returned, for the caller's check)
    outputs = next((o for o in outs[1:] if o != outs[0]), outs[0])
    eng.timed_captures = captured_classes(captures0)
    eng.pass_spread = max(walls) / min(walls)
    return statistics.median(walls), outputs, eng


def _host_us(eng: LLMEngine) -> dict:
    n = max(1, eng.timed_rounds)
    return {"schedule_us_per_round": eng.host_time["schedule"] / n * 1e6,
            "launch_us_per_round": eng.host_time["launch"] / n * 1e6,
            "pass_spread": eng.pass_spread, "warmup_passes": eng.warmups,
            "graph_captures": len(eng.timed_captures),
            "captured_classes": eng.timed_captures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch-sizes", default=None, help="default: 1,8,32 (cuda), 1,8 (cpu)")
    ap.add_argument("--drafts", default="2,4", help="draft counts d to run")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--decode-graphs", action="store_true",
                    help="on the CPU too (the fixed shapes, eagerly; pipelined speculation)")
    ap.add_argument("--out-dir", default=None, type=Path)
    a = ap.parse_args()
    graphs = True if a.decode_graphs else None
    cuda = a.device == "cuda"
    batches = [int(s) for s in (a.batch_sizes or ("1,8,32" if cuda else "1,8")).split(",")]
    drafts = [int(s) for s in a.drafts.split(",")]
    model = load(MODEL, dtype=torch.bfloat16 if cuda else torch.float32,
                 device="cuda" if cuda else "cpu", mtp=True)  # (unused but by the mtp rows)
    V = model.config.vocab_size
    params = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0.0)
    rows, failures = [], []
    for b in batches:
        g = torch.Generator().manual_seed(b)
        prompts = [torch.randint(2, V, (a.input_len,), generator=g).tolist() for _ in range(b)]
        wall, plain, eng = _pass(model, prompts, params, None, "plain", None, b, graphs)
        base_rate = b * (a.output_len - 1) / wall
        base_rounds = eng.timed_rounds
        base_host = _host_us(eng)
        eng.close()
        rows.append({"batch": b, "drafter": "plain", "drafts": 0,
                     "decode_tokens_per_s": base_rate, "rounds": base_rounds,
                     "tokens_per_round": b * (a.output_len - 1) / base_rounds / b,
                     "drafted": 0, "acceptance": None, "speedup": 1.0, "pipelined_rounds": 0,
                     "fraction_of_ideal": 1.0, **base_host})
        print(rows[-1], flush=True)
        for d in drafts:
            for drafter in ("ngram", "mtp", "oracle@1.0", "oracle@0.7"):
                spec = SpeculativeConfig(d, method="mtp" if drafter == "mtp" else "ngram")
                wall, out, eng = _pass(model, prompts, params, spec, drafter, plain, b, graphs)
                if out != plain:
                    failures.append(f"batch {b} d {d} {drafter}: tokens differ from plain")
                s = eng.scheduler
                rate = b * (a.output_len - 1) / wall
                per_round = (a.output_len - 1) / eng.timed_rounds
                rows.append({"batch": b, "drafter": drafter, "drafts": d,
                             "decode_tokens_per_s": rate, "rounds": eng.timed_rounds,
                             "tokens_per_round": per_round,
                             "drafted": s.num_drafted,
                             "acceptance": s.num_accepted / max(1, s.num_drafted),
                             "speedup": rate / base_rate,
                             "fraction_of_ideal": rate / (base_rate * per_round),
                             "pipelined_rounds": eng.scheduler.num_pipelined,
                             **_host_us(eng)})
                eng.close()
                print(rows[-1], flush=True)
    bench.print_table(rows, ["batch", "drafter", "drafts", "decode_tokens_per_s", "rounds",
                             "tokens_per_round", "drafted", "acceptance", "speedup",
                             "fraction_of_ideal", "pipelined_rounds", "schedule_us_per_round",
                             "launch_us_per_round", "pass_spread", "graph_captures"])
    for r in rows:
        if r["captured_classes"]:
            print(f"batch {r['batch']} {r['drafter']} d {r['drafts']}: the timed pass captured "
                  + "; ".join(r["captured_classes"]))
    path = bench.write_results("speculative", rows, device=a.device,
                               extra={"model": MODEL, "input_len": a.input_len,
                                      "decode_graphs": graphs,
                                      "output_len": a.output_len, "failures": failures},
                               out_dir=a.out_dir)
    print(f"wrote {path}")
    if failures:
        raise SystemExit("\n".join(failures))


if __name__ == "__main__":
    main()
