"""How many torch ops one decode step of the engine issues, and from where. On a GPU each is a
Python-level call and (mostly) a kernel launch, so at small batches the count, not the device,
sets the decode rate (bench/results/h200/README.md, engine.json). Runs anywhere; the count does
not depend on the device.

  python3 bench/probe_decode_ops.py [--model dummy] [--batches 1,8] [--top 15] [--launches]
                                    [--graphs]

--launches counts instead what would launch a GPU kernel (aten ops past views and allocations,
and calls into zeroinfer._C), by site - on the CPU, so the ops' CPU-only value checks count too.
Session 39: 394 a round at batch 1, 359 once the linears' row padding became a view of rows
their inputs' storage already holds (linear.pad_rows, empty_rows) - while torch calls rose
585 -> 664 (the size check, the view and the over-allocation are calls, not launches).

Per batch size: a prefill and one decode round first, then csa_rate decode rounds (a CSA
window's worth: one of them closes every sequence's window) counted under a torch function
mode, which sees every torch call made from Python (tensor methods and factory
functions included, attribute reads such as .shape excluded), attributed to the innermost
zeroinfer function on the stack. The emulated CPU device runs the round inline so its calls are
seen. Measured (session 35), the 4-layer dummy model at batch 1 / 8 / 32: 2910 / 5290 / 13358
calls a step at a83ed14 (1136 of them the hyper-connections' Sinkhorn loops; most of the rest at
batch 32 the compressors' and indexer's per-sequence loops), 1768 / 2160 / 3444 with mhc_mixes
and the batched compressors and indexer projections, 1218 / 1610 / 2894 with mhc_collapse / mhc_mix
and rope_rotate (session 36), 637 / 637 / 526 with indexer_scores, rms_norm and the per-step
derived tensors (session 37) - all of a round where no window closes. Over a CSA window's
rounds (session 38): 700 / 1204 / 2821 a round (the closing one 889 / 2905 / 9706: each closing
sequence pooled alone), 694 / 694 / 583 (865 / 865 / 754) with the closing sequences pooled
together, 600 / 600 / 533 with moe_route and FusedLinears, 567 / 567 / 500 (703 / 703 / 636)
with the compressors' per-step plan shared by every compressor of a rate and every closing window
pooled at once, 585 / 585 / 518 with the indexer's top-k a selection over int64 keys (9 torch
calls a CSA layer where the sort was 1; session 39).

--graphs (session 40): the engine's decode rounds in fixed shapes, which a GPU replays from one
CUDA graph: 444 launches every round at batch 1 and 8 (the eager rounds: 331 / 331 / 443 / 331),
61 of them the compressors' fixed-shape pooling (compress_decode: every row's window pooled every
step) and 15 its _entries - a fused compress kernel's share.
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from zeroinfer import _C
from zeroinfer.engine.engine import EngineConfig, LLMEngine
from zeroinfer.model import load
from zeroinfer.sampling_params import SamplingParams

# Attribute reads and conversions that launch nothing.
_FREE = {"__get__", "__len__", "size", "dim", "numel", "data_ptr", "element_size", "stride",
         "is_contiguous", "__index__", "__int__", "__bool__", "__format__", "__hash__",
         "storage_offset", "is_floating_point", "__iter__"}


def _site() -> str | None:
    """The innermost zeroinfer function on the stack of the counter's caller, as "path name"."""
    frame = sys._getframe(2)
    while frame is not None and "zeroinfer" not in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None:
        return None
    return f"{frame.f_code.co_filename.split('zeroinfer/')[-1]} {frame.f_code.co_name}"


class CallCounter(TorchFunctionMode):
    """Counts torch calls by the innermost zeroinfer function that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.by_site: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in _FREE:
            site = _site()
            if site is not None:
                self.by_site[site] += 1
        return func(*args, **(kwargs or {}))


# aten ops that allocate or describe memory but run no kernel on a GPU
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach",
              "lift_fresh", "alias", "set_", "resize_"}


class LaunchCounter(TorchDispatchMode):
    """Counts the aten ops that would run a kernel on a GPU (views, allocations and metadata
    excluded) and the calls into zeroinfer._C (one launch each), by zeroinfer site - what a GPU
    decode step launches, counted on any device. Host-to-device copies of host lists count as
    the aten copies they are on a GPU only (here on the CPU they are none): a lower bound."""

    def __init__(self) -> None:
        super().__init__()
        self.by_site: collections.Counter[str] = collections.Counter()
        self._saved: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _NO_KERNEL and not name.startswith("_local"):
            site = _site()
            if site is not None:
                self.by_site[site] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in dir(_C):  # each kernel entry point of _C counts where it is called
            fn = getattr(_C, name)
            if callable(fn) and not name.startswith("_") and name[0].islower():
                self._saved[name] = fn
                setattr(_C, name, self._counting(fn))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(_C, name, fn)
        return super().__exit__(*exc)

    def _counting(self, fn):
        def call(*args, **kwargs):
            site = _site()
            if site is not None:
                self.by_site[site] += 1
            return fn(*args, **kwargs)
        return call


def count_decode_step(model, batch: int, prompt_len: int = 32, rounds: int = 1,
                      counter_type=CallCounter,
                      graphs: bool = False) -> list[collections.Counter[str]]:
    """The calls of `rounds` consecutive decode rounds, one counter a round (graphs: the
    rounds in fixed shapes, as the engine captures them on a GPU)."""
    cfg = EngineConfig(max_num_seqs=batch, max_model_len=prompt_len + rounds + 8,
                       max_num_batched_tokens=batch * prompt_len, async_scheduling=False,
                       decode_graphs=graphs)
    engine = LLMEngine(model, cfg, seed=0)
    if engine.runner.emulated is not None:  # run the CPU "device" inline, in the mode's sight
        engine.runner.emulated.submit = lambda fn: fn()
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=rounds + 4, ignore_eos=True, temperature=0.0)
    for _ in range(batch):
        engine.add_request(torch.randint(2, model.config.vocab_size, (prompt_len,),
                                         generator=gen).tolist(), params)
    engine.step()  # prefill
    engine.step()  # a first decode round (one-time allocations)
    counters = []
    for _ in range(rounds):
        counter = counter_type()
        with counter:
            engine.step()
        counters.append(counter.by_site)
    engine.close()
    return counters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="dummy")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--launches", action="store_true",
                    help="count what would launch a GPU kernel (LaunchCounter), not torch calls")
    ap.add_argument("--graphs", action="store_true",
                    help="the decode rounds in fixed shapes (model/decode_graph.py): what one "
                         "CUDA graph replays a round on a GPU, plus the round's eager work")
    args = ap.parse_args()
    what = "kernel launches" if args.launches else "torch calls"
    counter_type = LaunchCounter if args.launches else CallCounter
    model = load(args.model, dtype=torch.float32, device="cpu")
    # One round per position of a CSA window: the round where every sequence's window closes
    # (the prompts share a length, so they close together) pools, the others only buffer.
    rounds = model.config.csa_rate
    for batch in (int(b) for b in args.batches.split(",")):
        per_round = count_decode_step(model, batch, rounds=rounds, counter_type=counter_type,
                                      graphs=args.graphs)
        totals = [sum(c.values()) for c in per_round]
        sites = sum(per_round, collections.Counter())
        print(f"batch {batch}: {sum(totals) / rounds:.0f} {what} a decode step, mean of "
              f"{rounds} (a CSA window's rounds: {' / '.join(map(str, totals))})")
        for site, n in sites.most_common(args.top):
            print(f"  {n / rounds:8.1f}  {site}")


if __name__ == "__main__":
    main()
