"""Moving routed-expert weights between ranks when the placement changes (after `rebalance`).

Every rank plans the same moves from the two placements alone: for each layer, a rank's new slot
takes its expert from the rank's own old slots when it held it (a local copy), else from a peer
that held it. The receivers of an expert are spread over its old holders in turn (receiver i of
expert e gets it from holder i mod #holders, both lists in rank order), so no single holder
sends every copy. An expert travels once to a rank, its four buffers packed into one message,
through point-to-point sends (`batch_isend_irecv`: NCCL or gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zeroinfer.parallel.eplb import Placement


def plan_moves(old: Placement, new: Placement, layer: int) -> list[tuple[int, int, int]]:
    """[(logical expert, receiving rank, sending rank)] of a layer, in (expert, receiver) order:
    every (rank, expert) the new placement puts where the old one did not."""
    N, S = old.num_ranks, old.slots_per_rank
    was = old.phys_to_logical[layer].cpu().view(N, S).tolist()
    now = new.phys_to_logical[layer].cpu().view(N, S).tolist()
    moves = []
    for e in sorted({e for row in now for e in row}):
        holders = [r for r in range(N) if e in was[r]]
        receivers = [r for r in range(N) if e in now[r] and e not in was[r]]
        moves += [(e, q, holders[i % len(holders)]) for i, q in enumerate(receivers)]
    return moves


def move_experts(layers: list[tuple[torch.Tensor, ...]], old: Placement, new: Placement,
                 rank: int, group: dist.ProcessGroup | None = None) -> int:
    """Rewrite this rank's expert buffers (layers[l]: the layer's buffers, slot-major [S, ...],
    any dtypes, on one device) from `old`'s placement to `new`'s, in place. A collective of the
    group. Returns the number of experts this rank received."""
    if old.num_ranks != new.num_ranks or old.num_physical != new.num_physical:
        raise ValueError("move_experts: the placements differ in ranks or slots")
    N, S = old.num_ranks, old.slots_per_rank
    received = 0
    for layer, bufs in enumerate(layers):
        was = old.phys_to_logical[layer].cpu().view(N, S)
        now = new.phys_to_logical[layer].cpu().view(N, S)
        if torch.equal(was, now):
            continue
        mine_was = was[rank].tolist()
        rows = [torch.cat([b[s].reshape(-1).view(torch.uint8) for b in bufs]) for s in range(S)]
        have = {e: rows[mine_was.index(e)] for e in set(mine_was)}  # snapshot of the old rows
        ops, inbox = [], {}
        for e, q, h in plan_moves(old, new, layer):
            if h == rank:
                ops.append(dist.P2POp(dist.isend, have[e], _global(q, group), group=group))
            if q == rank:
                inbox[e] = torch.empty_like(rows[0])
                ops.append(dist.P2POp(dist.irecv, inbox[e], _global(h, group), group=group))
        for req in dist.batch_isend_irecv(ops) if ops else []:
            req.wait()
        received += len(inbox)
        source = {**have, **inbox}
        for s, e in enumerate(now[rank].tolist()):
            _unpack(source[e], [b[s] for b in bufs])
    return received


def _global(rank: int, group) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _unpack(row: torch.Tensor, dsts: list[torch.Tensor]) -> None:
    at = 0
    for d in dsts:
        n = d.numel() * d.element_size()
        d.copy_(row[at:at + n].view(d.dtype).view(d.shape))
        at += n
