"""V4 attention block: low-rank queries, one shared K=V head of 512 (RoPE on the last 64),
a sliding window over a paged cache, and for CSA/HCA layers compressed entries (CSA picks
them per query with the lightning indexer). Core attention runs through
zeroinfer.ops.sparse_mla_attention; everything else here is plain torch.
"""

from __future__ import annotations

import torch
from torch import nn

from zeroinfer import ops
from zeroinfer.model.cache import (CompressorState, ForwardBatch, LayerCache,
                                  host_tensor, pool_block_size, scratch_slot, slots_of,
                                  write_pool)
from zeroinfer.model.config import CSA, HCA, SLIDING, ModelConfig
from zeroinfer.model.linear import FusedLinears, Linear, empty_rows, pad_rows
from zeroinfer.model.norm import rms_norm, rms_norm_unweighted
from zeroinfer.model.rope import RopeTables, apply_rope

# The most bytes of indexer scores a call holds ([rows, entries] float32, with top_entries'
# int64 keys beside them; DeepInfer bounds the same buffer by INDEX_ATTN_MEMORY_LIMIT).
INDEX_SCORES_MAX_BYTES = 256 << 20


# Below this many scores a CUDA top-k is the stable sort: on an H100 (bench_indexer_topk.py,
# h100-80gb-hbm3/indexer_topk.json) the selection's int64 radix passes took 54 us for 1 x 2048
# scores against the sort's 34, and lost up to 1M scores; it won only at 128 x 32768 (1.4x).
# On the CPU the selection is 1.7-3.5x faster from 8 queries or 8k entries (cpu-2core/).
TOPK_SELECT_MIN_CUDA = 1 << 22


def top_entries(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest of each row of scores [R, N] float32, as entry indices [R, k] int64 in
    descending order, equal scores by the lower index (-0 and +0 equal): a stable descending
    sort's first k. ReLU scores are often exactly 0, so ties are real, and the choice must not
    depend on anything but the row (chunked prefill, batch composition). By the sort itself or
    by select_top, whichever is faster where (TOPK_SELECT_MIN_CUDA); both give these indices."""
    if scores.is_cuda and scores.numel() < TOPK_SELECT_MIN_CUDA:
        return scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return select_top(scores, k)


def select_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """top_entries by a selection instead of a sort: each score becomes a unique int64 key, its
    float bits made order-preserving as a signed int in the high half and the inverted index in
    the low half, so torch.topk's choice and order are fully determined."""
    bits = (scores + 0.0).view(torch.int32)  # (+ 0.0: -0 -> +0)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    low = 0xFFFFFFFF - torch.arange(scores.shape[-1], device=scores.device)
    return ((ordered << 32) | low).topk(k, dim=-1).indices


def chosen_slots(tables: torch.Tensor, seq: torch.Tensor, chosen: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """The cache slots [T, K] int32 of each query's chosen entries (chosen [T, K], entry
    indices of the query's sequence seq[t]; -1 = none, kept)."""
    slots = slots_of(tables, seq[:, None].expand_as(chosen), chosen.clamp(min=0), block_size)
    return torch.where(chosen >= 0, slots, -1).to(torch.int32)


class NormWeight(nn.Module):
    """A weighted RMSNorm's parameter (kept float32, as HF does)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32))


def dense(in_f: int, out_f: int, dtype: torch.dtype) -> Linear:
    return Linear(in_f, out_f, dtype)


class WindowStarts:
    """Windows to pool, by their first positions (starts [k]): the compress table there is made
    once for every layer."""

    starts: torch.Tensor

    def cos_sin(self, rope: RopeTables, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        memo = self.__dict__.setdefault("_cos_sin", {})
        if dtype not in memo:
            memo[dtype] = rope.cos_sin("compress", self.starts, dtype)
        return memo[dtype]


class ClosingWindows(WindowStarts):
    """A step's windows that close, of every sequence, as the index tensors that pool them all
    at once (Compressor._pool_windows). A sequence's rows are its ring's rows of the open window
    (the first `held`) then its new tokens; window w of it covers rows w * m .. w * m + m - 1.
    group: (sequence, first new token's row in the step's tokens, new tokens, tokens held,
    state slot, the first window's position) per sequence that closes at least one window;
    size: the ring's (CompressorState.size).
      rows      [k, m] each window row's new token (0 where the row is the ring's)
      buffered  (window, row, slot, ring row) of the rows read from the ring, or None
      prev      [k] CSA: the window whose Ca half comes first (this step's window before; for a
                sequence's first window, itself, replaced by `saved` or `fresh`)
      saved     (window [n], slot [n, 1], ring rows [n, m]) of first windows after a complete
                one: that window's rows, whose Ca half comes first
      fresh     first windows with no window before them (a sequence's very first): no Ca half
                (0 with a -inf gate)
    Only the rows a window needs are read: a long prefill's windows past its first read none
    of the ring."""

    def __init__(self, group: list[tuple], rate: int, size: int, device: torch.device) -> None:
        m = rate
        self.seqs: list[int] = []   # each window's sequence, entry index and position
        self.index: list[int] = []
        starts, rows, prev = [], [], []
        buf_win, buf_row, buf_slot, buf_at = [], [], [], []
        saved_win, saved_slot, saved_at, fresh = [], [], [], []
        for i, lo, new, held, slot, start in group:
            for w in range((held + new) // m):
                g = len(starts)
                self.seqs.append(i)
                self.index.append(start // m + w)
                starts.append(start + w * m)
                rows += [max(lo + w * m + j - held, 0) for j in range(m)]
                if w == 0:
                    buf_win += [g] * held
                    buf_row += range(held)
                    buf_slot += [slot] * held
                    buf_at += [(start + j) % size for j in range(held)]
                    if start >= m:  # a complete window precedes the step: in the ring
                        saved_win.append(g)
                        saved_slot.append([slot])
                        saved_at.append([(start - m + j) % size for j in range(m)])
                    else:
                        fresh.append(g)
                prev.append(g - 1 if w else g)

        def tensors(*lists):
            return tuple(host_tensor(v, device) for v in lists) if lists[0] else None

        k = len(starts)
        self.rows = host_tensor(rows, device).view(k, m)
        self.buffered = tensors(buf_win, buf_row, buf_slot, buf_at)
        self.prev = host_tensor(prev, device)
        self.saved = tensors(saved_win, saved_slot, saved_at)
        self.fresh = host_tensor(fresh, device) if fresh else None
        self.starts = host_tensor(starts, device)


class DecodeWindows(WindowStarts):
    """A fixed-shape decode step's windows (ForwardBatch.decode), one a token, for a compressor
    of rate m and ring size `size`; the same for every compressor of those. Every token's
    window is pooled as if the token closed it (Compressor.compress_decode), and only those it
    does close are kept:
      new_at  [T] the token's ring row
      rows    [T, m] the window's ring rows; prev_rows [T, m] those of the window before
      closes  [T] bool: the token completes its window (never a padding row's)
      saved   [T] bool: a complete window precedes it (CSA: its Ca half is in the ring)
      index   [T] the window's entry index; starts [T] its first position."""

    def __init__(self, positions: torch.Tensor, real: torch.Tensor, m: int, size: int) -> None:
        held = positions % m
        self.closes = (held == m - 1) & real
        self.starts = positions - held
        self.saved = self.starts >= m
        self.index = torch.div(positions, m, rounding_mode="floor")
        self.new_at = positions % size
        j = torch.arange(m, device=positions.device)
        self.rows = (self.starts[:, None] + j) % size
        self.prev_rows = (self.starts[:, None] - m + j) % size


class CompressPlan:
    """How a step's tokens meet a compressor of rate m and ring size `size`, the same for every
    compressor of those (so made once a step, ForwardBatch.derived):
      windows   the windows that close, of every sequence (a ClosingWindows), or None
      written   the tokens the ring keeps (each sequence's last `size`): (token rows, or None
                where that is every token of the step; state slots; ring rows)
      seqs / index  each new entry's sequence and entry index (the windows' order)."""

    def __init__(self, batch: ForwardBatch, rate: int, size: int, device: torch.device) -> None:
        m, cu = rate, batch.cu_seqlens
        tokens, slots, at, closing = [], [], [], []
        for i in range(batch.num_seqs):
            lo, hi, ctx, slot = cu[i], cu[i + 1], batch.context_lens[i], batch.state_slots[i]
            held = ctx % m
            if (held + hi - lo) // m:  # windows this step closes
                closing.append((i, lo, hi - lo, held, slot, ctx - held))
            keep = max(lo, hi - size)  # (one token a ring row: an indexed write's targets differ)
            tokens += range(keep, hi)
            slots += [slot] * (hi - keep)
            at += [(ctx + t - lo) % size for t in range(keep, hi)]
        self.windows = ClosingWindows(closing, m, size, device) if closing else None
        self.seqs = self.windows.seqs if closing else []
        self.index = self.windows.index if closing else []
        every = len(tokens) == cu[-1]  # then tokens == 0 .. T - 1, and no gather is needed
        self.written = (None if every else host_tensor(tokens, device),
                        host_tensor(slots, device), host_tensor(at, device))


class Compressor(nn.Module):
    """Pools every `rate` tokens of one sequence into one entry of width `width`.

    HCA (overlap=False): softmax over the window's tokens, per channel, of gate + ape.
    CSA (overlap=True): each token projects two series (Ca | Cb); entry w pools the Cb half of
    window w together with the Ca half of window w-1 (2*rate slots). Then kv_norm and RoPE at
    the window's first position. Incomplete windows wait in the per-sequence state.
    """

    def __init__(self, hidden: int, width: int, rate: int, overlap: bool, eps: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        series = 2 if overlap else 1
        self.width, self.rate, self.overlap, self.eps = width, rate, overlap, eps
        self.kv_proj = dense(hidden, series * width, dtype)
        self.gate_proj = dense(hidden, series * width, dtype)
        self.position_bias = nn.Parameter(torch.empty(rate, series * width, dtype=torch.float32))
        self.kv_norm = NormWeight(width)

    def compress_batch(self, kv_all: torch.Tensor, gate_all: torch.Tensor, batch: ForwardBatch,
                       state: CompressorState, rope: RopeTables,
                       ) -> tuple[list[int], list[int], torch.Tensor | None]:
        """Every sequence's new tokens' projections kv_all / gate_all [T, series * width] (batch
        order; kv_proj / gate_proj of the layer input, made by the attention's one GEMM): every
        window that closes, of every sequence, pooled at once, then the tokens written to the
        state's ring by one indexed write. Returns the new entries [N, width] with each one's
        sequence and entry index (lists of N), entries None if there are none, and updates the
        state. The plan (which token goes where, as index tensors) is the batch's, the rate's
        and the ring's alone, so every compressor of these in the step shares one."""
        plan = batch.derived(("compress_plan", self.rate, state.size),
                             lambda: CompressPlan(batch, self.rate, state.size, kv_all.device))
        entries = None
        if plan.windows is not None:  # (reads the ring before the write below)
            entries = self._pool_windows(kv_all, gate_all, plan.windows, state, rope)
        tok, sl, at = plan.written
        if tok is not None:  # (None: every token of the step, in order)
            kv_all, gate_all = kv_all[tok], gate_all[tok]
        state.kv[sl, at] = kv_all.float()
        state.gate[sl, at] = gate_all.float()
        return plan.seqs, plan.index, entries

    def compress_decode(self, kv_all: torch.Tensor, gate_all: torch.Tensor,
                        batch: ForwardBatch, state: CompressorState, rope: RopeTables,
                        ) -> tuple[torch.Tensor, DecodeWindows]:
        """compress_batch's fixed-shape form, for a decode step (batch.decode: the same number
        of tokens a row, the positions on the device): the step's tokens go to the ring, then
        every token's window is pooled from the ring as if the token closed it, and the caller
        keeps the entries of those that do (DecodeWindows.closes). The ring holds every
        position a window reads (CompressorState.size: a row's tokens past the first are at
        most max_discard). No shape or write count depends on the lengths, so a CUDA graph can
        hold it. The entries that close have compress_batch's bits (a window's operations are
        its own, and the ring's float32 copy of a projection casts back to its own bits).
        Returns (entries [T, width], the tokens' DecodeWindows)."""
        m, w, slot = self.rate, self.width, batch.decode.state_slots
        wins = batch.derived(("decode_windows", m, state.size), lambda: DecodeWindows(
            batch.positions, batch.decode.real, m, state.size))
        state.kv[slot, wins.new_at] = kv_all.float()
        state.gate[slot, wins.new_at] = gate_all.float()
        ck = state.kv[slot[:, None], wins.rows].to(kv_all.dtype)
        cg = state.gate[slot[:, None], wins.rows].to(gate_all.dtype) + self.position_bias
        if self.overlap:  # the Ca half before: the ring's where a complete window precedes
            saved = wins.saved[:, None, None]
            prev_kv = state.kv[slot[:, None], wins.prev_rows, :w].to(ck.dtype)
            prev_gate = (state.gate[slot[:, None], wins.prev_rows, :w].to(gate_all.dtype)
                         + self.position_bias[:, :w])
            ca_kv = torch.where(saved, prev_kv, 0.0)
            ca_gate = torch.where(saved, prev_gate, float("-inf"))
            ck = torch.cat([ca_kv, ck[..., w:]], dim=1)
            cg = torch.cat([ca_gate, cg[..., w:]], dim=1)
        return self._entries(ck, cg, wins.cos_sin(rope, ck.dtype)), wins

    def _pool_windows(self, kv_all: torch.Tensor, gate_all: torch.Tensor, wins: ClosingWindows,
                      state: CompressorState, rope: RopeTables) -> torch.Tensor:
        """Entries [k, width] of the closing windows (in wins' order), all at once; each
        window's operations are its own, so its bits do not depend on the others
        (tests/model/test_compressor.py)."""
        w = self.width
        ck, cg = kv_all[wins.rows], gate_all[wins.rows]
        if wins.buffered is not None:
            win, row, slot, at = wins.buffered
            ck[win, row] = state.kv[slot, at].to(ck.dtype)
            cg[win, row] = state.gate[slot, at].to(cg.dtype)
        cg = cg + self.position_bias
        if self.overlap:
            # Rows 0 .. m - 1: the Ca half of the window before (this step's, else the ring's
            # where a complete window precedes, else none: 0 with a -inf gate); then own Cb.
            ca_kv, ca_gate = ck[..., :w][wins.prev], cg[..., :w][wins.prev]
            if wins.saved is not None:
                win, slot, at = wins.saved
                ca_kv[win] = state.kv[slot, at, :w].to(ck.dtype)
                ca_gate[win] = (state.gate[slot, at, :w].to(gate_all.dtype)
                                + self.position_bias[:, :w])
            if wins.fresh is not None:  # (index_fill_: a Python scalar, no host-to-device copy)
                ca_kv.index_fill_(0, wins.fresh, 0.0)
                ca_gate.index_fill_(0, wins.fresh, float("-inf"))
            ck = torch.cat([ca_kv, ck[..., w:]], dim=1)
            cg = torch.cat([ca_gate, cg[..., w:]], dim=1)
        return self._entries(ck, cg, wins.cos_sin(rope, ck.dtype))

    def _entries(self, ck: torch.Tensor, cg: torch.Tensor,
                 cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Windows' rows ck / cg [n, rows, width] pooled into entries [n, width]: the gate's
        softmax over the rows weighs the kv, then kv_norm and RoPE at each window's first
        position (cos_sin: the compress table there, [n, r / 2] each)."""
        # The softmax runs along the last, contiguous dim (the rows transposed there): torch's
        # CPU softmax over an inner dim splits the work into vector chunks and a scalar tail
        # by the tensor's shape and thread count, and the two exp forms differ in the last bit,
        # so a window's weights would depend on how many windows are pooled together. Along
        # the last dim each window's row is done alone, the same bits at any n.
        weights = cg.transpose(1, 2).softmax(dim=-1, dtype=torch.float32).transpose(1, 2)
        pooled = (ck * weights.to(ck.dtype)).sum(dim=1)
        entries = rms_norm(pooled, self.kv_norm.weight, self.eps)
        return apply_rope(entries, *cos_sin)


class IndexerScorer(nn.Module):
    def __init__(self, hidden: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weights_proj = dense(hidden, heads, dtype)


class Indexer(Compressor):
    """The lightning indexer of a CSA layer: its own compressor at width index_head_dim, and
    per-query scores sum_h w_h * ReLU(q_h . k_s) / sqrt(d_I) used to pick the top-k entries."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config.hidden_size, config.index_head_dim, config.csa_rate, True,
                         config.rms_norm_eps, dtype)
        self.heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = dense(config.q_lora_rank, config.index_n_heads * config.index_head_dim,
                              dtype)
        self.scorer = IndexerScorer(config.hidden_size, config.index_n_heads, dtype)

    def queries(self, head_logits: torch.Tensor, q_res: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query's index heads, rotated, q [T, heads, d_I] float32, and head weights
        [T, heads] float32, for the whole batch: head_logits [T, heads] the scorer's
        weights_proj of the layer input (the attention's one GEMM), q_res [T, d_q], cos / sin
        of the compress table at the queries' positions."""
        T = q_res.shape[0]
        q = apply_rope(self.q_b_proj(q_res).view(T, self.heads, self.width), cos, sin).float()
        return q, head_logits.float() * self.heads**-0.5

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               tables: torch.Tensor, seq: torch.Tensor, visible: torch.Tensor, num_entries: int,
               width: int) -> torch.Tensor:
        """Every query's top-k entries [T, width] (-1 = none) by the indexer's scores over the
        paged keys, for the whole batch at once: q [T, heads, d_I] and weights [T, heads] from
        `queries`, keys the layer's index cache, tables the sequences' CSA block tables, seq /
        visible each query's sequence and the entries it sees ((position + 1) // rate),
        num_entries the most entries a sequence of the batch holds, width the most top-k a
        sequence has (min(topk, its entries))."""
        T = q.shape[0]
        # Scores are [T, num_entries] float32 (and top_entries' keys int64): long prefills go
        # by row chunks of bounded size.
        rows = max(1, INDEX_SCORES_MAX_BYTES // (12 * max(1, num_entries)))
        chosen = []
        for lo in range(0, max(T, 1), rows):  # (T = 0: one empty call)
            hi = min(T, lo + rows)
            vis = visible[lo:hi]
            scores = ops.indexer_scores(q[lo:hi], weights[lo:hi], keys, tables, seq[lo:hi], vis,
                                        num_entries, scale=self.width**-0.5)
            # Ties broken by entry index, so the choice never depends on how many entries the
            # scored row holds (chunked prefill, batch composition: a row's scores past its own
            # sequence's entries, like those past what it sees, are -inf and rank after them).
            top = top_entries(scores, width)
            chosen.append(torch.where(top >= vis[:, None], -1, top))
        return chosen[0] if len(chosen) == 1 else torch.cat(chosen)


class CSACompressor(Compressor):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config.hidden_size, config.head_dim, config.csa_rate, True,
                         config.rms_norm_eps, dtype)
        self.indexer = Indexer(config, dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.config, self.kind = c, c.layer_kind(layer)
        self.table = "main" if self.kind == SLIDING else "compress"
        H, d = c.num_attention_heads, c.head_dim
        self.q_a_proj = dense(c.hidden_size, c.q_lora_rank, dtype)
        self.q_a_norm = NormWeight(c.q_lora_rank)
        self.q_b_proj = dense(c.q_lora_rank, H * d, dtype)
        self.kv_proj = dense(c.hidden_size, d, dtype)
        self.kv_norm = NormWeight(d)
        # Grouped output projection: group g (heads g*H/G .. ) -> o_lora_rank, then mix.
        self.o_a_proj = dense(H * d // c.o_groups, c.o_groups * c.o_lora_rank, dtype)
        self.o_b_proj = dense(c.o_groups * c.o_lora_rank, c.hidden_size, dtype)
        self.sinks = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.compressor: Compressor | None = None
        if self.kind == CSA:
            self.compressor = CSACompressor(c, dtype)
        elif self.kind == HCA:
            self.compressor = Compressor(c.hidden_size, d, c.hca_rate, False, c.rms_norm_eps, dtype)
        # Every projection of the layer input in one GEMM (FusedLinears): the queries' low rank
        # and K=V, and the compressor's and the indexer's kv / gate and head weights.
        proj = [self.q_a_proj, self.kv_proj]
        if self.compressor is not None:
            proj += [self.compressor.kv_proj, self.compressor.gate_proj]
        if self.kind == CSA:
            ix = self.compressor.indexer
            proj += [ix.kv_proj, ix.gate_proj, ix.scorer.weights_proj]
        self.x_proj = FusedLinears(*proj)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache,
                rope: RopeTables) -> torch.Tensor:
        c = self.config
        T, H, d, eps = x.shape[0], c.num_attention_heads, c.head_dim, c.rms_norm_eps
        pos = batch.positions
        seq = batch.seq_of_token()
        cos, sin = batch.derived(("cos_sin", self.table, x.dtype),
                                 lambda: rope.cos_sin(self.table, pos, x.dtype))

        q_a, kv_x, *comp_proj = self.x_proj(x)
        q_res = rms_norm(q_a, self.q_a_norm.weight, eps)
        q = rms_norm_unweighted(self.q_b_proj(q_res).view(T, H, d), eps)
        q = apply_rope(q, cos, sin)
        kv = apply_rope(rms_norm(kv_x, self.kv_norm.weight, eps), cos, sin)

        # The window: write this step's K=V, then each query reads its last W positions.
        B = pool_block_size(cache.window)
        write, win_idx = batch.derived(("window", B), lambda: self._window_slots(batch, B))
        write_pool(cache.window, write, kv)

        extra_cache = extra_idx = None
        if self.compressor is not None:
            extra_idx = self._compressed_indices(comp_proj, q_res, batch, seq, cache, rope,
                                                 cos, sin)
            extra_cache = cache.comp
        out, _ = ops.sparse_mla_attention(
            q.contiguous(), cache.window, win_idx, d**-0.5, attn_sink=self.sinks,
            extra_kv_cache=extra_cache, extra_indices=extra_idx)
        # Undo the RoPE carried by V = K (at the query's position), into rows that pad for free.
        out = apply_rope(out, cos, sin, inverse=True,
                         out=empty_rows(tuple(out.shape), out.dtype, out.device))
        G = c.o_groups
        grouped, _ = pad_rows(out.reshape(T, G, H * d // G))
        w_a = self.o_a_proj.weight.view(G, c.o_lora_rank, H * d // G)
        y = torch.bmm(grouped.transpose(0, 1), w_a.transpose(1, 2))  # [G, T', d_g]
        # all T' rows copied out, so that o_b_proj's padding is a view of them
        y = y.transpose(0, 1).reshape(grouped.shape[0], G * c.o_lora_rank)[:T]
        return self.o_b_proj(y)

    @staticmethod
    def _hca_slots(batch: ForwardBatch, tables: torch.Tensor, visible: torch.Tensor, width: int,
                   Bc: int) -> torch.Tensor:
        """HCA: every query's visible entries' slots [T, width] int32 (-1 = none)."""
        seq = batch.seq_of_token()
        chosen = torch.arange(width, device=seq.device)[None, :].expand(seq.shape[0], width)
        return chosen_slots(tables, seq, torch.where(chosen < visible[:, None], chosen, -1), Bc)

    def _window_slots(self, batch: ForwardBatch, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache slots this step's tokens write [T], and each query's window of its last W
        positions [T, W] int32 (-1 before the sequence's start); the same for every layer."""
        pos, seq, W = batch.positions, batch.seq_of_token(), self.config.sliding_window
        write = slots_of(batch.window_tables, seq, pos, B)
        win_pos = pos[:, None] - (W - 1) + torch.arange(W, device=pos.device)
        win_idx = slots_of(batch.window_tables, seq[:, None].expand_as(win_pos),
                           win_pos.clamp(min=0), B)
        return write, torch.where(win_pos >= 0, win_idx, -1).to(torch.int32).contiguous()

    def _compressed_indices(self, proj, q_res, batch: ForwardBatch, seq, cache: LayerCache,
                            rope: RopeTables, cos, sin) -> torch.Tensor:
        """Compress this step's tokens of every sequence into the layer's cache and return, per
        query, the slots of the compressed entries it attends to ([T, K2] int32, -1 = none).
        proj: the layer input's projections past q_a / kv (x_proj): the compressor's kv, gate,
        then (CSA) the indexer's kv, gate and head logits. cos / sin: the layer's (the compress
        table) at the queries' positions."""
        comp = self.compressor
        assert comp is not None
        m = comp.rate
        csa = self.kind == CSA
        tables = batch.csa_tables if csa else batch.hca_tables
        Bc = pool_block_size(cache.comp)

        def store(pool: torch.Tensor, compressor: Compressor, state: CompressorState, kv_all,
                  gate_all) -> None:
            """The step's new entries into pool, by one indexed write."""
            if batch.decode is not None:  # every row writes: a window that stays open, scratch
                entries, wins = compressor.compress_decode(kv_all, gate_all, batch, state, rope)
                at = batch.derived(("decode_slots", m, csa, Bc), lambda: torch.where(
                    wins.closes, slots_of(tables, seq, torch.where(wins.closes, wins.index, 0),
                                          Bc), scratch_slot(pool)))
                write_pool(pool, at, entries)
                return
            seqs, index, entries = compressor.compress_batch(kv_all, gate_all, batch, state, rope)
            if entries is not None:
                dev = pool.device
                at = batch.derived(("compress_slots", m, csa, Bc), lambda: slots_of(
                    tables, host_tensor(seqs, dev), host_tensor(index, dev), Bc))
                write_pool(pool, at, entries)

        store(cache.comp, comp, cache.state["compressor"], proj[0], proj[1])
        # Entries of each sequence after this step (n_max: the most; a fixed-shape decode step
        # takes what the tables hold); a query sees those of windows closed at or before its
        # position.
        if batch.decode is not None:
            n_max = tables.shape[1] * Bc
        else:
            n_max = max([(batch.context_lens[i] + batch.cu_seqlens[i + 1] - batch.cu_seqlens[i])
                         // m for i in range(batch.num_seqs)] + [0])
        visible = batch.derived(("visible", m),
                                lambda: torch.div(batch.positions + 1, m, rounding_mode="floor"))
        if not csa:  # HCA: every closed window is visible, for all queries at once
            return batch.derived(("hca", m, Bc), lambda: self._hca_slots(batch, tables, visible,
                                                                        n_max, Bc))
        ix = comp.indexer
        store(cache.index, ix, cache.state["indexer"], proj[2], proj[3])
        iq, iw = ix.queries(proj[4], q_res, cos, sin)
        # Each query's top-k at most: min(topk, n_max). (Past the entries a query sees, its
        # picks are -1: a wider list only adds -1 columns.)
        width = min(ix.topk, n_max)
        chosen = ix.select(iq, iw, cache.index, tables, seq, visible, n_max, width)
        return chosen_slots(tables, seq, chosen, Bc)
