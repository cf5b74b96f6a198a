"""Expert parallelism: this rank's routed experts, and the token exchange of an MoE layer.

Every rank of the group runs its own batch through attention (data-parallel attention) and
holds S of the P physical expert slots (`Placement`). In an MoE layer each rank

  1. routes its tokens (logical expert ids), picks a replica of each chosen expert (the physical
     slot; `ExpertParallel.replicas`) and so the rank that computes it;
  2. sends each token once to every rank holding one of its experts, with the k local slot ids
     there (-1 for slots served elsewhere) and the routing weights (`all_to_all_single`);
  3. runs its local experts on what it received - the single-device MoE path on local ids - and
     sums each row's experts weighted (the combine), so one partial row goes back per (token,
     rank);
  4. gets the partial rows back and adds them up per token in rank order.

The counts are exchanged first and read on the host, so that form runs eagerly. Inside
`fixed_capacity(C)` (decode graphs: model/decode_graph.py) the layer reads nothing on the host and
can be captured in a CUDA graph: every rank's C token rows go to every rank (an all-gather; a
token's metadata names no local slot on a rank that holds none of its experts, which then adds
nothing), and C partial rows come back from each rank. It moves N x C rows each way instead of
one row per (token, rank holding one of its experts) - 1.8x at 8 ranks and top-6 (a token's
experts sit on 4.4 of 8 ranks when spread evenly) - the price of fixed shapes on NCCL, whose
collectives take their sizes from the host.
A token's result depends only on the token (its routing, its replica hash) and the placement,
never on the batch or on the form: the summation order is fixed (slots inside a rank, then
ranks in order; a rank holding none of its experts adds an exact zero).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from zeroinfer.parallel.eplb import Placement, initial_placement, num_physical_experts, rebalance
from zeroinfer.parallel.expert_load import ExpertLoad
from zeroinfer.parallel.shuffle import move_experts

# Odd 64-bit multipliers (as int64) for the replica hash.
_MIX = 0x2545F4914F6CDD1D
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)

# compute(x [M, D], local slot ids [M, k] int32 (-1: elsewhere), weights [M, k] float32)
#   -> [M, D]: the weighted sum of the row's local experts.
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertParallel:
    """One rank's share of an expert-parallel group: the placement (on the compute device), the
    group, and optionally the expert-load window that feeds `rebalance`."""

    def __init__(self, placement: Placement, group: dist.ProcessGroup | None = None, *,
                 device: torch.device | str = "cpu", load_window: int = 0,
                 rebalance_interval: int = 0) -> None:
        """load_window: count the experts' load over that many steps (0: not counted).
        rebalance_interval: `end_step` calls for a rebalance every that many steps, the first
        after a quarter of it (a cold start's placement is the worst); 0: never."""
        self.group = group if group is not None else dist.group.WORLD
        self.size = _world_size(group)
        self.rank = dist.get_rank(self.group)
        if placement.num_ranks != self.size:
            raise ValueError(f"ExpertParallel: the placement is for {placement.num_ranks} ranks, "
                             f"the group has {self.size}")
        # Votes on the host (does any rank step?) go over their own gloo group: the exchange's
        # collectives may be running on the group at that moment from another thread (the CPU
        # engine's emulated device), and two threads must not share a group. Made by this
        # group's ranks alone (use_local_synchronization): with several expert-parallel groups
        # (subgroups of the world) each group's ranks pass their own rank list here, which a
        # world-wide new_group would mix up under one name (and hang).
        self.vote_group = dist.new_group(dist.get_process_group_ranks(self.group),
                                         backend="gloo", use_local_synchronization=True)
        self.device = torch.device(device)
        self.placement = placement.to(self.device)
        if rebalance_interval and not 1 <= load_window <= rebalance_interval:
            raise ValueError(f"ExpertParallel: rebalancing every {rebalance_interval} steps needs "
                             f"1 <= load_window <= it, got load_window={load_window}")
        self.load = (ExpertLoad(placement.num_layers, placement.num_logical, load_window,
                                self.device) if load_window > 0 else None)
        self.rebalance_interval = rebalance_interval
        self._fixed: tuple[int, torch.Tensor | None, bool] | None = None  # fixed_capacity's
        # The group's communicator is made now, by a collective every rank runs here: NCCL
        # makes it lazily, on first use, which must not be inside a CUDA graph's capture.
        dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank of the group (a host-side collective)."""
        return bool(self.group_max([int(flag)])[0])

    def group_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of `values` over the group's ranks (a host-side collective:
        every rank passes as many)."""
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.vote_group)
        return t.tolist()

    @contextmanager
    def fixed_capacity(self, capacity: int, valid: torch.Tensor | None = None, *,
                       loopback: bool = False) -> Iterator[None]:
        """Inside, `run` exchanges `capacity` token rows with every rank and reads nothing on
        the host (CUDA-graph capturable). Every rank must be inside with the same capacity for
        the same layers. valid: [>= T] bool on the device, False for padding rows (no expert,
        not counted in the load). loopback: no collective at all - the rows come back to this
        rank as if every rank had sent these (results meaningless, shapes and allocations those
        of the real exchange): for a graph's warm-up runs, which one rank makes alone."""
        if capacity < 1:
            raise ValueError(f"ExpertParallel.fixed_capacity: capacity must be >= 1, got "
                             f"{capacity}")
        old, self._fixed = self._fixed, (capacity, valid, loopback)
        try:
            yield
        finally:
            self._fixed = old

    def end_step(self) -> bool:
        """Close this step's expert counts; True when a rebalance is due."""
        if self.load is None:
            return False
        self.load.step()
        n, every = self.load.steps, self.rebalance_interval
        return bool(every) and (n == max(1, every // 4) or n % every == 0)

    def rebalance(self, layers: list[tuple[torch.Tensor, ...]]) -> bool:
        """A new placement from the load window (summed over the group) and this rank's expert
        buffers (layers[l]: the layer's slot-major buffers) moved to it. A collective; returns
        whether the placement changed."""
        if self.load is None or self.load.steps == 0:
            raise RuntimeError("ExpertParallel.rebalance: no expert load was counted "
                               "(load_window=0, or no step ended yet)")
        new = rebalance(self.load.window_load(self.group), self.placement.num_physical, self.size,
                        current=self.placement)
        if new.same_as(self.placement):
            return False
        move_experts(layers, self.placement, new, self.rank, self.group)
        self.placement = new.to(self.device)
        return True

    @classmethod
    def for_model(cls, config, *, redundant_experts: int = 0,
                  group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu",
                  load_window: int = 0, rebalance_interval: int = 0) -> ExpertParallel:
        """This rank's part for a model (its ModelConfig, e.g. zeroinfer.model.model_config):
        the n_routed_experts + redundant_experts slots (rounded up to the group's size) in the
        initial placement (expert i mod E in slot i)."""
        world = _world_size(group)
        E = config.n_routed_experts
        P = num_physical_experts(E, world, redundant_experts)
        return cls(initial_placement(config.num_hidden_layers, E, P, world), group,
                   device=device, load_window=load_window, rebalance_interval=rebalance_interval)

    @property
    def slots(self) -> int:
        """Physical expert slots on each rank."""
        return self.placement.slots_per_rank

    def local_experts(self) -> torch.Tensor:
        """[L, S] int64 on the CPU: the logical expert of each of this rank's slots."""
        return self.placement.local_experts(self.rank).cpu()

    def replicas(self, layer: int, topk_ids: torch.Tensor, token_keys: torch.Tensor
                 ) -> torch.Tensor:
        """The physical slot serving each (token, slot) pair: a replica of its expert picked by
        a hash of the token's key (e.g. its id and position) and the slot. A function of the
        token alone - its batch, row and rank play no part, so neither does the grouping of its
        experts into ranks, nor its sum's order: EP stays batch-invariant - and over many
        tokens an even split over the copies (the split EPLB assumes)."""
        pl = self.placement
        ids = topk_ids.long()
        j = torch.arange(ids.shape[1], device=ids.device)
        h = token_keys.long().unsqueeze(1) * _MIX + j * _GOLDEN  # int64 arithmetic wraps
        h = h ^ (h >> 29)
        choice = h % pl.logical_count[layer][ids]
        return pl.logical_to_phys[layer][ids, choice]

    def run(self, layer: int, y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            token_keys: torch.Tensor, compute: LocalExperts) -> torch.Tensor:
        """The routed experts' output [T, D] (y's dtype) for this rank's tokens (token_keys [T]
        int: what picks a token's replicas, see `replicas`). A collective: every rank of the
        group calls it for every MoE layer, with T = 0 if it has no tokens."""
        if self._fixed is not None:
            return self._run_fixed(layer, y, topk_ids, topk_weights, token_keys, compute)
        if self.load is not None:
            self.load.record(layer, topk_ids)
        N, S, g = self.size, self.slots, self.group
        T, k = topk_ids.shape
        dev = y.device
        phys = self.replicas(layer, topk_ids, token_keys)
        dest = phys // S
        # One row per (token, rank holding any of its experts), ordered by rank, then token.
        tok = torch.arange(T, device=dev).repeat_interleave(k)
        hit = torch.zeros(N * T, dtype=torch.bool, device=dev)
        hit.index_fill_(0, dest.reshape(-1) * T + tok, True)
        hit = hit.view(N, T)
        d_sel, t_sel = hit.nonzero(as_tuple=True)
        mine = dest[t_sel] == d_sel.unsqueeze(1)
        send_ids = torch.where(mine, phys[t_sel] % S, -1).to(torch.int32)
        send_w = torch.where(mine, topk_weights[t_sel].float(), 0.0)
        meta = torch.cat([send_ids, send_w.view(torch.int32)], 1)
        send_counts = torch.bincount(d_sel, minlength=N)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=g)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        M, R = sum(sc), sum(rc)
        x_in = _exchange(y[t_sel].contiguous(), R, rc, sc, g)
        m_in = _exchange(meta, R, rc, sc, g)
        part = compute(x_in, m_in[:, :k].contiguous(), m_in[:, k:].contiguous().view(torch.float32))
        back = _exchange(part.to(y.dtype).contiguous(), M, sc, rc, g)
        return _sum_per_token(back, t_sel, T, min(k, N)).to(y.dtype)

    def _run_fixed(self, layer: int, y: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor, token_keys: torch.Tensor,
                   compute: LocalExperts) -> torch.Tensor:
        """`run` inside fixed_capacity: C rows to and from every rank, no host reads."""
        C, valid, loopback = self._fixed
        N, S, g = self.size, self.slots, self.group
        T, k = topk_ids.shape
        D, dev = y.shape[1], y.device
        if T > C:
            raise ValueError(f"ExpertParallel: {T} tokens exceed the fixed capacity {C}")
        ids = topk_ids.long()
        if valid is not None:  # padding rows route nowhere
            ids = torch.where(valid[:T].unsqueeze(1), ids, -1)
        if self.load is not None:
            self.load.record(layer, ids)
        phys = self.replicas(layer, ids.clamp(min=0), token_keys)
        dest = torch.where(ids >= 0, phys // S, -1)
        # Rank d's metadata: the local slot of each of a token's experts that d holds, else -1.
        mine = dest.unsqueeze(0) == torch.arange(N, device=dev).view(N, 1, 1)  # [N, T, k]
        meta = torch.full((N, C, 2 * k), -1, dtype=torch.int32, device=dev)
        meta[:, :T, :k] = torch.where(mine, (phys % S).unsqueeze(0), -1).to(torch.int32)
        meta[:, :T, k:] = torch.where(mine, topk_weights.float().unsqueeze(0),
                                      0.0).view(torch.int32)
        meta[:, T:, k:] = 0  # (0.0's bits)
        x = y.new_zeros(C, D)
        x[:T] = y
        if loopback:
            x_in, m_in = x.repeat(N, 1), meta.view(N * C, 2 * k)
        else:
            x_in = _gather_rows(x, N, g)
            m_in = _exchange(meta.view(N * C, 2 * k), N * C, [C] * N, [C] * N, g)
        part = compute(x_in, m_in[:, :k].contiguous(), m_in[:, k:].contiguous().view(torch.float32))
        part = part.to(y.dtype).contiguous()
        back = part if loopback else _exchange(part, N * C, [C] * N, [C] * N, g)
        back = back.view(N, C, D)[:, :T].float()
        out = back[0]  # (then += in rank order: a rank holding none of the token's experts
        for r in range(1, N):  # sent an exact zero, so the sum is the variable form's)
            out = out + back[r]
        return out.to(y.dtype)


def _gather_rows(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """all_gather_into_tensor of every rank's [C, D] rows -> [n * C, D] (16-bit as bytes)."""
    out = x.new_empty(n * x.shape[0], *x.shape[1:])
    if x.element_size() == 2:
        dist.all_gather_into_tensor(out.view(torch.uint8), x.view(torch.uint8), group=group)
    else:
        dist.all_gather_into_tensor(out, x, group=group)
    return out


def _world_size(group: dist.ProcessGroup | None) -> int:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ExpertParallel: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    return dist.get_world_size(group)


def _exchange(x: torch.Tensor, rows_in: int, split_in: list[int], split_out: list[int],
              group) -> torch.Tensor:
    """all_to_all_single of rows; 16-bit floats travel as bytes (gloo has no bfloat16, NCCL no
    int16; both move uint8, and a row's bytes split with it)."""
    out = x.new_empty(rows_in, *x.shape[1:])
    if x.element_size() == 2:
        dist.all_to_all_single(out.view(torch.uint8), x.view(torch.uint8), split_in, split_out,
                               group=group)
    else:
        dist.all_to_all_single(out, x, split_in, split_out, group=group)
    return out


def _sum_per_token(rows: torch.Tensor, token: torch.Tensor, T: int, most: int) -> torch.Tensor:
    """out[t] = the sum, in float32 and in row order, of the rows whose token is t (at most
    `most` rows a token; explicit adds, so the order never depends on T)."""
    M, D = rows.shape
    dev = rows.device
    order = torch.sort(token, stable=True).indices  # rows grouped by token, in rank order
    count = torch.bincount(token, minlength=T)
    first = torch.cumsum(count, 0) - count
    nth = torch.arange(M, device=dev) - first[token[order]]
    pos = torch.full((T, most), M, dtype=torch.long, device=dev)
    pos[token[order], nth] = order
    padded = torch.cat([rows.float(), rows.new_zeros(1, D, dtype=torch.float32)])
    out = padded[pos[:, 0]]
    for i in range(1, most):
        out += padded[pos[:, i]]
    return out
