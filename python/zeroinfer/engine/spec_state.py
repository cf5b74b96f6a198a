"""Speculative decoding's per-slot state on the device, so that verification rounds can be
pipelined (the zero-overhead way): a round launched before the previous one is committed takes
its rows' lengths and ids from here, where the previous round's epilogue left them.

Per slot: the token history by position, the length (tokens through the pending bonus token:
the next row's context length is length - 1), and the next verification row's ids (the bonus
token, then the drafts) with the number of real drafts. `advance` runs after every round's
draws, on the device: it keeps each row's inputs in the history, finds how many drafts the
draws confirm, writes the emitted tokens, and drafts the next row by n-gram lookup over the
history - NgramIndex's rule (engine/speculative.py: the latest earlier occurrence of the
longest suffix n-gram, with a continuation), vectorised over the rows.
"""

from __future__ import annotations

import torch

from zeroinfer.engine.speculative import SpeculativeConfig


class SpeculativeState:
    def __init__(self, slots: int, max_len: int, spec: SpeculativeConfig,
                 device: torch.device) -> None:
        """slots: state slots (one more, the scratch slot, is kept for padding rows); max_len:
        the positions a sequence may reach."""
        D = spec.num_draft_tokens
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
        proposed, count = self.propose(slots, length)
        self.next_ids[slots] = torch.cat([bonus, proposed], dim=1)
        self.drafts[slots] = count
        return kept

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
