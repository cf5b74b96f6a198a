"""zeroinfer.parallel: expert parallelism (the placement of routed experts over ranks, the
token exchange of an MoE layer, the expert-load balancer and the weight moves it needs).
Runs on any torch.distributed backend: NCCL on GPUs, gloo on CPUs (how the tests run it)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from zeroinfer.parallel.eplb import (
    Placement,
    imbalance,
    initial_placement,
    num_physical_experts,
    rank_loads,
    rebalance,
)
from zeroinfer.parallel.expert_load import ExpertLoad
from zeroinfer.parallel.expert_parallel import ExpertParallel
from zeroinfer.parallel.shuffle import move_experts, plan_moves


def check_placement(pl: Placement, config) -> None:
    """The placement is one of this model's layers and routed experts."""
    if pl.num_layers != config.num_hidden_layers or pl.num_logical != config.n_routed_experts:
        raise ValueError(f"expert parallelism: the placement has {pl.num_layers} layers x "
                         f"{pl.num_logical} experts, the model {config.num_hidden_layers} x "
                         f"{config.n_routed_experts}")


def local_expert_tensors(tensors: Iterable[tuple[str, torch.Tensor]], config,
                         ep: ExpertParallel) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) stream with each layer's stacked routed experts cut to
    this rank's slots (a replicated expert is copied into each of its slots)."""
    from zeroinfer.model.weights import EXPERT_BUFFER

    check_placement(ep.placement, config)
    local = ep.local_experts()
    for name, t in tensors:
        m = EXPERT_BUFFER.match(name)
        yield name, (t.index_select(0, local[int(m[1])].to(t.device)) if m else t)


__all__ = ["ExpertLoad", "ExpertParallel", "Placement", "check_placement", "imbalance",
           "initial_placement", "local_expert_tensors", "move_experts", "num_physical_experts",
           "plan_moves", "rank_loads", "rebalance"]
