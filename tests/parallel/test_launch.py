"""run_ranks, the multi-process launcher of the expert-parallel tests and `--ep-ranks`."""

from __future__ import annotations

import pytest
from zeroinfer.parallel.launch import run_ranks


def _unpicklable_worker(rank, world):
    return (lambda: rank) if rank == 1 else rank


def test_run_ranks_names_a_rank_whose_result_cannot_be_sent():
    # Rank 1's return value cannot be pickled, so it never reaches the parent: refused by name
    # as soon as the rank has exited, not after waiting out the timeout.
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] exited without sending a result"):
        run_ranks(_unpicklable_worker, 2, timeout=60)
