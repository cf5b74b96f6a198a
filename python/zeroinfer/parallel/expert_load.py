"""Per-step expert load, counted on the device, kept over a ring window of steps for EPLB."""

from __future__ import annotations

import torch
import torch.distributed as dist


class ExpertLoad:
    """Tokens routed to each logical expert of each MoE layer, step by step.

    `record` adds a layer's routing ids to the current step's counts without a host sync (a
    scatter-add on the ids' device); `step` closes the step into a ring of the last `window`
    steps. `window_load` is the ring in step order, summed over the expert-parallel group: every
    rank then holds the same load and computes the same placement.
    """

    def __init__(self, num_layers: int, num_experts: int, window: int,
                 device: torch.device | str = "cpu") -> None:
        if num_layers < 1 or num_experts < 1 or window < 1:
            raise ValueError(f"ExpertLoad: need num_layers, num_experts, window >= 1; got "
                             f"{num_layers}, {num_experts}, {window}")
        self.window = window
        self.current = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.ring = torch.zeros(window, num_layers, num_experts, dtype=torch.int64, device=device)
        self.steps = 0  # steps closed so far

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count a layer's logical routing ids ([T, k], -1 ignored)."""
        ids = topk_ids.reshape(-1).long()
        keep = (ids >= 0).long()
        row = self.current[layer]
        row.scatter_add_(0, ids.clamp(min=0), keep)

    def step(self) -> None:
        self.ring[self.steps % self.window].copy_(self.current)
        self.current.zero_()
        self.steps += 1

    def window_load(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """[min(steps, window), L, E] int64 on the CPU, oldest step first; summed over `group`
        when one is given (a collective: every rank of it must call)."""
        n = min(self.steps, self.window)
        start = self.steps - n
        idx = torch.tensor([(start + i) % self.window for i in range(n)], dtype=torch.long,
                           device=self.ring.device)
        w = self.ring.index_select(0, idx).contiguous()
        if group is not None:
            dist.all_reduce(w, group=group)
        return w.cpu()
