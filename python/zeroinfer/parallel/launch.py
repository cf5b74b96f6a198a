"""Start N ranks of a process group on this machine, one process each, and collect what each
returns: the CLI's `--ep-ranks` and the tests of the expert-parallel code (CPU ranks over gloo,
how it is tested without several GPUs; one GPU a rank over NCCL)."""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 90


def _rank_main(fn, rank: int, world: int, store: str, args: tuple, results,
               backend: str) -> None:
    torch.set_num_threads(1)  # N ranks share the machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        # A rank left waiting in a collective (a test's bug) errors out after this, not gloo's
        # default 30 minutes.
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        try:
            results.put((rank, True, fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # reported to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable, world: int, *args, timeout: float = 600.0,
              backend: str = "gloo") -> list:
    """fn(rank, world, *args) on `world` spawned processes with a process group set up (gloo;
    "nccl" for one GPU a rank); returns the ranks' results in rank order (picklable values), or
    raises with the failing ranks' tracebacks. fn must be importable by name (a module-level
    function)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world, store, args, results, backend))
                 for r in range(world)]
        for p in procs:
            p.start()
        got, errors = {}, []
        quiet: set[int] = set()  # ranks seen exited cleanly with no result yet
        deadline = time.monotonic() + timeout
        try:
            while len(got) < world and not errors:
                try:
                    rank, ok, value = results.get(timeout=1.0)
                except queue.Empty:
                    # A rank that died before reporting (killed, or it failed to start: every
                    # other exit reports first) would leave the others waiting: stop at once.
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    # A clean exit flushed its result into the queue first; none by the next
                    # empty poll means it was never sent (the queue's feeder thread could not
                    # pickle it): stop then, not at the deadline.
                    lost = {r for r, p in enumerate(procs) if p.exitcode == 0 and r not in got}
                    if dead:
                        errors.append(f"rank(s) {dead} exited (codes "
                                      f"{[procs[r].exitcode for r in dead]}) without a result")
                    elif lost & quiet:
                        errors.append(f"rank(s) {sorted(lost & quiet)} exited without sending "
                                      "a result (fn must return a picklable value; the rank's "
                                      "stderr has the pickling error)")
                    elif time.monotonic() > deadline:
                        errors.append(f"no result within {timeout} s")
                    quiet |= lost
                    continue
                if ok:
                    got[rank] = value
                else:
                    errors.append(f"rank {rank}:\n{value}")
        finally:
            for p in procs:
                p.join(timeout=5 if errors or len(got) < world else 60)
                if p.is_alive():
                    p.kill()
    if errors or len(got) < world:
        raise RuntimeError("run_ranks: " + ("\n".join(errors) or
                                            f"only ranks {sorted(got)} of {world} finished"))
    return [got[r] for r in range(world)]
