"""Expert placement for expert parallelism, and its load balancer (EPLB).

P physical expert slots - the E logical (routed) experts plus R redundant copies - are split
evenly over the N ranks of the expert-parallel group: rank r holds slots r*S .. r*S + S-1
(S = P / N). A `Placement` says, for every MoE layer, which logical expert each slot holds.

The balancer (`rebalance`) follows DeepInfer's global policy: from a window of per-step expert
loads it
  1. gives the R redundant slots one at a time to the expert whose extra copy most lowers the
     summed (over the window's steps) peak per-replica load, and
  2. places the replicas, heaviest first, each on the rank with free slots where it least raises
     the summed per-step peak rank load (a longest-processing-time packing that balances each
     step's peak, not only the mean), never two copies of one expert on a rank while another
     rank has room (a second local copy would take no load off any other rank).
Everything here is plain torch on the CPU, identical on every rank (no communication): ranks that
feed it the same all-reduced load agree on the placement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def num_physical_experts(num_experts: int, num_ranks: int, extra: int = 0) -> int:
    """E + extra rounded up to a multiple of the rank count (every rank holds as many slots)."""
    if num_experts < 1 or num_ranks < 1 or extra < 0:
        raise ValueError(f"num_physical_experts: need num_experts >= 1, num_ranks >= 1, "
                         f"extra >= 0; got {num_experts}, {num_ranks}, {extra}")
    p = num_experts + extra
    return -(-p // num_ranks) * num_ranks


@dataclass(frozen=True)
class Placement:
    """Which logical expert each physical slot holds, per MoE layer (all int64, on one device)."""

    phys_to_logical: torch.Tensor  # [L, P]
    logical_to_phys: torch.Tensor  # [L, E, max replicas], -1 padded; replicas in slot order
    logical_count: torch.Tensor  # [L, E], >= 1
    num_ranks: int

    @property
    def num_layers(self) -> int:
        return self.phys_to_logical.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phys_to_logical.shape[1]

    @property
    def num_logical(self) -> int:
        return self.logical_count.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    def local_experts(self, rank: int) -> torch.Tensor:
        """[L, S]: the logical expert of each of `rank`'s slots."""
        s = self.slots_per_rank
        return self.phys_to_logical[:, rank * s:(rank + 1) * s]

    def to(self, device: torch.device | str) -> Placement:
        return Placement(self.phys_to_logical.to(device), self.logical_to_phys.to(device),
                         self.logical_count.to(device), self.num_ranks)

    def same_as(self, other: Placement) -> bool:
        return (self.num_ranks == other.num_ranks
                and torch.equal(self.phys_to_logical.cpu(), other.phys_to_logical.cpu()))

    @staticmethod
    def from_phys_to_logical(phys_to_logical: torch.Tensor, num_experts: int,
                             num_ranks: int) -> Placement:
        """Builds the inverse maps; refuses a map that leaves an expert without a slot."""
        p2l = torch.as_tensor(phys_to_logical, dtype=torch.int64).cpu()
        if p2l.ndim != 2:
            raise ValueError(f"Placement: phys_to_logical must be [layers, slots], got "
                             f"shape {tuple(p2l.shape)}")
        L, P = p2l.shape
        if num_ranks < 1 or P % num_ranks:
            raise ValueError(f"Placement: {P} slots do not split evenly over {num_ranks} ranks")
        if p2l.numel() and (int(p2l.min()) < 0 or int(p2l.max()) >= num_experts):
            raise ValueError(f"Placement: phys_to_logical values must be in [0, {num_experts})")
        count = torch.zeros(L, num_experts, dtype=torch.int64)
        count.scatter_add_(1, p2l, torch.ones_like(p2l))
        if L and int(count.min()) < 1:
            layer, expert = divmod(int(torch.argmin(count.flatten())), num_experts)
            raise ValueError(f"Placement: layer {layer}: logical expert {expert} has no slot")
        width = int(count.max()) if L else 1
        l2p = torch.full((L, num_experts, width), -1, dtype=torch.int64)
        # Replicas in slot order: a stable sort of the slots by logical id, then each one's
        # rank among its expert's slots.
        order = torch.sort(p2l, dim=1, stable=True).indices
        sorted_e = torch.gather(p2l, 1, order)
        first = torch.cumsum(count, 1) - count
        nth = torch.arange(P).expand(L, P) - torch.gather(first, 1, sorted_e)
        layer = torch.arange(L).unsqueeze(1).expand(L, P)
        l2p[layer, sorted_e, nth] = order
        return Placement(p2l, l2p, count, num_ranks)


def initial_placement(num_layers: int, num_experts: int, num_physical: int,
                      num_ranks: int) -> Placement:
    """Slot i holds expert i mod E (DeepInfer's start: the redundant slots repeat 0, 1, ...)."""
    if num_physical < num_experts:
        raise ValueError(f"initial_placement: {num_physical} slots cannot hold {num_experts} "
                         "experts")
    p2l = (torch.arange(num_physical) % num_experts).expand(num_layers, -1)
    return Placement.from_phys_to_logical(p2l, num_experts, num_ranks)


def _window(load: torch.Tensor, name: str = "load") -> torch.Tensor:
    load = torch.as_tensor(load)
    if load.ndim == 2:
        load = load.unsqueeze(0)
    if load.ndim != 3:
        raise ValueError(f"{name} must be [layers, experts] or [steps, layers, experts], got "
                         f"shape {tuple(load.shape)}")
    if load.is_floating_point() and not torch.isfinite(load).all():
        raise ValueError(f"{name} must be finite")
    if (load < 0).any():
        raise ValueError(f"{name} must be non-negative")
    return load.detach().cpu().to(torch.float64)


def _replicate(load: torch.Tensor, extra: int) -> torch.Tensor:
    """load [W, E] -> replica counts [E] (sum E + extra): each redundant slot goes to the expert
    whose extra copy gives the smallest summed per-step peak per-replica load; ties to the expert
    with the larger mean per-replica load, then the lower id."""
    W, E = load.shape
    count = torch.ones(E, dtype=torch.float64)
    mean = load.mean(0)
    for _ in range(extra):
        per = load / count  # [W, E]
        top = torch.topk(per, min(2, E), dim=1)
        m1, i1 = top.values[:, 0], top.indices[:, 0]
        m2 = top.values[:, 1] if E > 1 else torch.zeros(W, dtype=torch.float64)
        # Peak of step w if expert j gets a copy: only the step's argmax can lower it.
        score = m1.sum().expand(E).clone()
        lowered = torch.maximum(m2, load[torch.arange(W), i1] / (count[i1] + 1))
        score.index_add_(0, i1, lowered - m1)
        best = score.min()
        tied = torch.nonzero(score <= best + 1e-9 * best.abs().clamp(min=1)).flatten()
        j = tied[torch.argmax(mean[tied] / count[tied])]  # argmax: the first of equal values
        count[j] += 1
    return count.to(torch.int64)


def _place(load: torch.Tensor, count: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """load [W, E], replica counts [E] -> phys_to_logical [P] (S slots a rank)."""
    W, E = load.shape
    P = int(count.sum())
    S = P // num_ranks
    experts = torch.repeat_interleave(torch.arange(E), count)
    per = load[:, experts] / count[experts]  # [W, P]: each replica's per-step load
    # Heaviest replicas first (by the window's total); ties by expert id, a stable order.
    order = torch.sort(-per.sum(0), stable=True).indices
    rank_load = torch.zeros(W, num_ranks, dtype=torch.float64)
    free = torch.full((num_ranks,), S, dtype=torch.int64)
    holds = torch.zeros(num_ranks, E, dtype=torch.bool)
    members: list[list[int]] = [[] for _ in range(num_ranks)]  # replica indices a rank
    for i in order.tolist():
        e = int(experts[i])
        open_ = free > 0
        fresh = open_ & ~holds[:, e]
        cand = fresh if fresh.any() else open_
        peak = rank_load.max(1).values  # [W]
        new_peak = torch.maximum(peak.unsqueeze(1), rank_load + per[:, i:i + 1])  # [W, N]
        score = new_peak.sum(0)
        total = rank_load.sum(0)
        # Least summed peak; ties to the least loaded rank, then the lowest rank.
        key = torch.where(cand, score, torch.inf)
        tied = cand & (key <= key.min() + 1e-9 * key.min().abs().clamp(min=1))
        r = int(torch.nonzero(tied).flatten()[torch.argmin(total[tied])])
        rank_load[:, r] += per[:, i]
        free[r] -= 1
        holds[r, e] = True
        members[r].append(i)
    placed = _improve_by_swaps(per, experts, torch.tensor(members, dtype=torch.int64))
    # Inside a rank, slots in logical order: a placement is a function of the load alone.
    return torch.sort(experts[placed], dim=1).values.flatten()


# The swap search stops when no swap lowers the summed peak by this fraction. At V4 sizes (256
# experts, 8-16 ranks, 100-step windows) it takes 0.03-0.08 s a layer and gets within ~1% of
# the 1e-9 search's balance, which takes 1-1.5 s a layer.
SWAP_MIN_GAIN = 1e-3


def _improve_by_swaps(per: torch.Tensor, experts: torch.Tensor,
                      members: torch.Tensor) -> torch.Tensor:
    """Local search after the greedy packing: swap two replicas on different ranks while that
    lowers the summed per-step peak rank load. The greedy pass cannot see ahead (two experts that
    peak on different steps look as good apart as together when the first is placed); a swap
    fixes that. Only a swap with a step's peak rank can lower that step's peak, so each round
    tries the peak ranks, heaviest first, against every other rank, and takes the first rank's
    best improving swap; the search ends where no swap gains SWAP_MIN_GAIN of the objective (a
    local optimum up to that; smaller steps cost more time than they return). Swaps never
    put a second copy of an expert on a rank. per [W, P], experts [P], members [N, S] replica
    indices -> members improved."""
    W, P = per.shape
    N, S = members.shape
    if N < 2:
        return members
    members = members.clone()
    held = torch.zeros(N, int(experts.max()) + 1, dtype=torch.bool)
    held[torch.arange(N).unsqueeze(1), experts[members]] = True
    for _ in range(4 * P):
        rl = per[:, members].sum(2)  # [W, N]
        top = torch.topk(rl, min(3, N), dim=1)
        objective = float(top.values[:, 0].sum())
        # Peak ranks by how far they stand above the next rank, summed over their steps.
        lead = torch.zeros(N, dtype=per.dtype).index_add_(
            0, top.indices[:, 0], top.values[:, 0] - top.values[:, 1])
        swap = None
        for a in torch.argsort(lead, descending=True, stable=True).tolist():
            if lead[a] <= 0 and a != int(top.indices[0, 0]):
                break
            swap = _best_swap(per, experts, members, held, rl, top, a,
                              SWAP_MIN_GAIN * max(objective, 1.0))
            if swap is not None:
                break
        if swap is None:
            break
        a, i, b, j = swap
        ea, eb = int(experts[members[a, i]]), int(experts[members[b, j]])
        held[a, ea], held[b, eb], held[a, eb], held[b, ea] = False, False, True, True
        members[a, i], members[b, j] = members[b, j].clone(), members[a, i].clone()
    return members


def _best_swap(per, experts, members, held, rl, top, a: int, min_gain: float):
    """(a, i, b, j): the swap of a's replica i with rank b's replica j that lowers the summed
    per-step peak most, by more than min_gain; None if none does."""
    W = per.shape[0]
    N, S = members.shape
    b = torch.tensor([r for r in range(N) if r != a])  # [B]
    pa, pb = per[:, members[a]], per[:, members[b]]  # [W, S], [W, B, S]
    delta = pb.unsqueeze(3) - pa.view(W, 1, 1, S)  # [W, B, S_b, S_a]: j of b for i of a
    new_a = rl[:, a].view(W, 1, 1, 1) + delta
    new_b = rl[:, b].view(W, -1, 1, 1) - delta
    # Each step's peak over the ranks other than a and b: the first such rank of its top 3.
    idx, val = top.indices, top.values  # [W, <=3]
    other = torch.zeros(W, b.numel(), dtype=per.dtype)
    for t in reversed(range(idx.shape[1])):
        free = (idx[:, t:t + 1] != a) & (idx[:, t:t + 1] != b.view(1, -1))
        other = torch.where(free, val[:, t:t + 1].expand_as(other), other)
    new_peak = torch.maximum(torch.maximum(new_a, new_b), other.view(W, -1, 1, 1))
    gain = float(val[:, 0].sum()) - new_peak.sum(0)  # [B, S_b, S_a]
    ea, eb = experts[members[a]], experts[members[b]]  # [S], [B, S]
    ok = ~held[b].gather(1, ea.expand(b.numel(), S)).unsqueeze(1)  # a's expert not on b
    ok = ok & ~held[a][eb].unsqueeze(2)  # b's expert not on a
    gain = torch.where(ok & (eb.unsqueeze(2) != ea.view(1, 1, S)), gain, -torch.inf)
    flat = int(torch.argmax(gain))
    if float(gain.flatten()[flat]) <= min_gain:
        return None
    bi, rest = divmod(flat, S * S)
    j, i = divmod(rest, S)
    return a, i, int(b[bi]), j


def rebalance(load: torch.Tensor, num_physical: int, num_ranks: int,
              current: Placement | None = None) -> Placement:
    """A balanced placement for `load` ([layers, experts] or a window [steps, layers, experts]
    of per-step token counts per logical expert, the same on every rank). With `current`, a
    layer keeps current's slots unless the new ones lower its summed per-step peak rank load:
    the greedy balancer (replicate, then pack) can do worse than the placement in use - e.g. a
    hot expert given 3 copies on 2 ranks, two of them on one rank - and a move that does not
    help only costs its weight transfer."""
    w = _window(load)
    W, L, E = w.shape
    if W == 0:
        raise ValueError("rebalance: the load window has no steps")
    if num_ranks < 1 or num_physical < E or num_physical % num_ranks:
        raise ValueError(f"rebalance: num_physical ({num_physical}) must be >= the {E} experts "
                         f"and a multiple of num_ranks ({num_ranks})")
    p2l = torch.stack([_place(w[:, layer], _replicate(w[:, layer], num_physical - E), num_ranks)
                       for layer in range(L)]) if L else torch.zeros(0, num_physical)
    fresh = Placement.from_phys_to_logical(p2l, E, num_ranks)
    if current is None:
        return fresh
    current = current.to("cpu")
    if (current.num_layers, current.num_logical, current.num_physical, current.num_ranks) != (
            L, E, num_physical, num_ranks):
        raise ValueError(f"rebalance: current is a placement of {current.num_layers} layers x "
                         f"{current.num_logical} experts in {current.num_physical} slots on "
                         f"{current.num_ranks} ranks; the load and arguments ask for {L} x {E} "
                         f"in {num_physical} on {num_ranks}")
    peak_fresh = rank_loads(w, fresh).amax(2).sum(0)  # [L]
    peak_now = rank_loads(w, current).amax(2).sum(0)
    better = peak_fresh < peak_now * (1 - 1e-9)  # (equal: no move)
    p2l = torch.where(better.unsqueeze(1), fresh.phys_to_logical, current.phys_to_logical)
    return Placement.from_phys_to_logical(p2l, E, num_ranks)


def rank_loads(load: torch.Tensor, placement: Placement) -> torch.Tensor:
    """[W, L, N] float64: each rank's load when every expert's tokens split evenly over its
    replicas (what the replica rule of `ExpertParallel` does on average)."""
    w = _window(load)
    pl = placement.to("cpu")
    if w.shape[1:] != (pl.num_layers, pl.num_logical):  # (gather would cut extra layers off)
        raise ValueError(f"rank_loads: the load is for {w.shape[1]} layers x {w.shape[2]} "
                         f"experts, the placement for {pl.num_layers} x {pl.num_logical}")
    per_slot = torch.gather(w / pl.logical_count.double().unsqueeze(0), 2,
                            pl.phys_to_logical.unsqueeze(0).expand(w.shape[0], -1, -1))
    return per_slot.unflatten(2, (pl.num_ranks, pl.slots_per_rank)).sum(3)


def imbalance(load: torch.Tensor, placement: Placement) -> float:
    """Summed per-step peak rank load over summed mean rank load (1.0 = perfectly balanced),
    all layers together."""
    r = rank_loads(load, placement)
    mean = r.mean(2).sum()
    return float(r.max(2).values.sum() / mean) if mean > 0 else 1.0
