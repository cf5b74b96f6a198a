"""Speculative decoding's per-slot state on the device, so that verification rounds can be
pipelined (the zero-overhead way): a round launched before the previous one is committed takes
its rows' lengths and ids from here, where the previous round's epilogue left them.

Per slot: the token history by position, the length (tokens through the pending bonus token:
the next row's context length is length - 1), and the next verification row's ids (the bonus
token, then the drafts) with the number of real drafts. `advance` runs after every round's
draws, on the device: it keeps each row's inputs in the history, finds how many drafts the
draws confirm, writes the emitted tokens, and drafts the next row by n-gram lookup over the
history - NgramIndex's rule (engine/speculative.py: the latest earlier occurrence of the
longest suffix n-gram, with a continuation), vectorised over the rows. With the MTP drafter
(method "mtp") the lookup is off: engine/mtp_drafter.py writes the drafts after the epilogue
(`set_drafts`).

`advance` is ~140 small device operations: launched one by one from the host they cost more
than a small batch's forward (the H100 bench at batch 1: launch time 0.86 -> 1.4-4.5 ms a round).
With `fixed_shapes` it runs on rows padded to the decode graphs' row classes (padding rows on the
scratch slot), captured in one CUDA graph a (rows, tokens) class on a GPU and run eagerly in the
same padded form on the CPU, where the tests check it against the unpadded one.
"""

from __future__ import annotations

import torch

from zeroinfer.engine.speculative import SpeculativeConfig
from zeroinfer.model.decode_graph import ROW_BUCKETS, capture_graph, row_bucket


class SpeculativeState:
    def __init__(self, slots: int, max_len: int, spec: SpeculativeConfig,
                 device: torch.device, *, fixed_shapes: bool = False) -> None:
        """slots: state slots (one more, the scratch slot, is kept for padding rows); max_len:
        the positions a sequence may reach; fixed_shapes: run `advance` on padded rows (a CUDA
        graph a class on a GPU)."""
        D = spec.num_draft_tokens
        self.ngram = spec.method == "ngram"  # else the MTP drafter's drafts (set_drafts)
        self.scratch = slots
        self.fixed_shapes = fixed_shapes
        self.cuda = torch.device(device).type == "cuda"
        self.capture = self.cuda  # the fixed-shape epilogue in CUDA graphs (use_proposer)
        # (rows class, tokens) -> (packed inputs [rows, 3 + 2q], their padding rows, kept
        # [rows], graph or None)
        self.classes: dict[tuple[int, int], tuple] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.cuda and fixed_shapes else None
        self.D, self.min_n, self.max_n = D, spec.min_ngram, spec.max_ngram
        # every position a row may write (a verification row past max_len by its drafts), and
        # one junk column for the writes that must land nowhere
        self.L = max_len + 2 * (D + 1) + 1
        self.junk = self.L - 1
        i64 = dict(dtype=torch.int64, device=device)
        self.hist = torch.zeros(slots + 1, self.L, **i64)
        self.length = torch.zeros(slots + 1, **i64)
        self.next_ids = torch.zeros(slots + 1, 1 + D, **i64)
        self.drafts = torch.zeros(slots + 1, **i64)

    def write(self, slots: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> None:
        """A round's input tokens into the history (slots / positions / ids [T]); positions
        past the history go to the junk column."""
        at = torch.where(positions < self.junk, positions, self.junk)
        self.hist[slots, at] = ids

    def advance(self, slots: torch.Tensor, ctx: torch.Tensor, ids: torch.Tensor,
                drafts: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
        """After a round's draws, for its R sampling rows: slots / ctx (the row's first
        position) / drafts (real drafts in the row) [R], ids / draws [R, q] (the row's inputs
        and the draws at its positions: draws[:, j] is the token at position ctx + 1 + j; a
        plain row is q = 1). Returns the drafts each row keeps [R]."""
        R, q = draws.shape
        if self.fixed_shapes and 1 <= R <= ROW_BUCKETS[-1]:
            return self._advance_fixed(slots, ctx, ids, drafts, draws)
        return self._advance(slots, ctx, ids, drafts, draws)

    def _advance_fixed(self, slots, ctx, ids, drafts, draws) -> torch.Tensor:
        """advance on the rows padded to their class: one copy of the packed inputs, the
        padding rows' (the scratch slot's, drafting nothing), then the class's graph."""
        R, q = draws.shape
        n = row_bucket(R)
        cls = self.classes.get((n, q))
        if cls is None:
            cls = self.classes[(n, q)] = self._make_class(n, q)
        packed, padding, kept, graph = cls
        packed[:R].copy_(torch.cat([slots[:, None], ctx[:, None], drafts[:, None], ids, draws],
                                   dim=1))
        if R < n:
            packed[R:].copy_(padding[R:])
        if graph is None:
            return self._advance_packed(packed, q, kept)[:R]
        graph.replay()
        return kept[:R]

    def _padding(self, rows: int, q: int) -> torch.Tensor:
        pad = torch.zeros(rows, 3 + 2 * q, dtype=torch.int64, device=self.hist.device)
        pad[:, 0] = self.scratch
        return pad

    def _advance_packed(self, packed: torch.Tensor, q: int, kept: torch.Tensor) -> torch.Tensor:
        kept.copy_(self._advance(packed[:, 0], packed[:, 1], packed[:, 3: 3 + q], packed[:, 2],
                                 packed[:, 3 + q:]))
        return kept

    def _make_class(self, n: int, q: int) -> tuple:
        """A class's fixed tensors, and on a GPU its graph, captured on padding rows alone (they
        write only the scratch slot)."""
        packed, padding = self._padding(n, q), self._padding(n, q)
        kept = torch.zeros(n, dtype=torch.int64, device=packed.device)
        if not self.capture:
            return packed, padding, kept, None
        graph, _ = capture_graph(lambda: self._advance_packed(packed, q, kept), packed.device,
                                 self.pool, what=f"epilogue rows={n} q={q}")
        return packed, padding, kept, graph

    def _advance(self, slots, ctx, ids, drafts, draws) -> torch.Tensor:
        R, q = draws.shape
        j = torch.arange(q, device=draws.device)
        if q > 1:
            ok = (draws[:, :-1] == ids[:, 1:]) & (j[None, :-1] < drafts[:, None])
            kept = ok.to(torch.int64).cumprod(1).sum(1)
        else:
            kept = torch.zeros(R, dtype=torch.int64, device=draws.device)
        # the emitted tokens (the kept drafts, then the bonus) at ctx + 1 .. ctx + 1 + kept
        pos = ctx[:, None] + 1 + j
        at = torch.where((j[None] <= kept[:, None]) & (pos < self.junk), pos, self.junk)
        self.hist[slots[:, None].expand(R, q), at] = draws
        length = ctx + 2 + kept
        self.length[slots] = length
        bonus = draws.gather(1, kept[:, None])
        if self.ngram:
            proposed, count = self.propose(slots, length)
            self.next_ids[slots] = torch.cat([bonus, proposed], dim=1)
            self.drafts[slots] = count
        else:  # (the MTP drafter writes the drafts after the epilogue: set_drafts)
            self.next_ids[slots, :1] = bonus
        return kept

    def use_proposer(self, propose, *, capturable: bool) -> None:
        """Draft with `propose(slots, length) -> (drafts [R, D], count [R])` in place of the
        n-gram lookup (tests and benchmarks: zeroinfer.testing.drafts). capturable: whether it
        can run inside a CUDA graph (no host reads, no generator state); the classes captured
        with the lookup are dropped."""
        self.propose = propose
        self.capture = self.capture and capturable
        self.classes.clear()

    def set_drafts(self, slots: torch.Tensor, drafts: torch.Tensor) -> None:
        """A device drafter's drafts [R, D] as the rows' next drafts (all D offered)."""
        self.next_ids[slots, 1:] = drafts
        self.drafts[slots] = drafts.shape[1]

    def propose(self, slots: torch.Tensor, length: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to D drafts a row [R, D] (0 past the count) and their count [R]: what followed
        the latest earlier occurrence of the longest suffix n-gram (n from max_n down to
        min_n) of the row's history[:length]."""
        h = self.hist[slots]  # [R, L]
        R = h.shape[0]
        dev = h.device
        best = torch.full((R,), -1, dtype=torch.int64, device=dev)
        for n in range(self.max_n, self.min_n - 1, -1):
            k = torch.arange(n, device=dev)
            suffix = h.gather(1, (length[:, None] - n + k).clamp(min=0))  # [R, n]
            match = (h.unfold(1, n, 1) == suffix[:, None, :]).all(-1)  # [R, L - n + 1]
            i = torch.arange(match.shape[1], device=dev)
            ok = match & (i[None] + n < length[:, None]) & (length[:, None] >= n)
            last = torch.where(ok, i[None], -1).amax(1)
            best = torch.where((best < 0) & (last >= 0), last + n, best)
        count = torch.where(best >= 0, (length - best).clamp(max=self.D), 0)
        d = torch.arange(self.D, device=dev)
        proposed = h.gather(1, (best.clamp(min=0)[:, None] + d).clamp(max=self.junk))
        return torch.where(d[None] < count[:, None], proposed, 0), count
