"""A small driver of the graph over paged caches for a fixed set of sequence slots: it owns
the caches, gives every slot a fixed range of blocks of each kind, builds the ForwardBatch of
a step, and serves the simple public calls (teacher-forced logits, greedy decoding). The
engine's scheduler (continuous batching, preemption, block reuse) builds its batches itself.
"""

from __future__ import annotations

import math

import torch

from zeroinfer.model.cache import CacheSpec, ForwardBatch, allocate_caches
from zeroinfer.model.decode_graph import DecodeGraphs
from zeroinfer.model.deepseek_v4 import DeepseekV4ForCausalLM


class PagedRunner:
    def __init__(self, net: DeepseekV4ForCausalLM, *, max_seqs: int = 4, max_len: int = 1024,
                 window_block_size: int = 16, csa_block_size: int = 8, hca_block_size: int = 2,
                 device: torch.device | str | None = None, decode_graphs: bool = False,
                 kv_fp8: bool = False, max_discard: int = 0) -> None:
        """decode_graphs: run steps where every sequence has the same number of new tokens
        through DecodeGraphs (CUDA graphs on a GPU; the same fixed-shape forward eagerly on the
        CPU). kv_fp8: the K=V caches in the V4 FP8 layout (CacheSpec.kv_fp8). max_discard: the
        most tokens of a step that `discard` may take back (CacheSpec.max_discard)."""
        c = net.config
        self.net, self.max_len, self.max_seqs = net, max_len, max_seqs
        self.device = torch.device(device) if device else next(net.parameters()).device
        self.nw = math.ceil(max_len / window_block_size)
        self.nc = max(1, math.ceil(max_len // c.csa_rate / csa_block_size))
        self.nh = max(1, math.ceil(max_len // c.hca_rate / hca_block_size))
        self.spec = CacheSpec(self.nw * max_seqs, self.nc * max_seqs, self.nh * max_seqs, max_seqs,
                              window_block_size, csa_block_size, hca_block_size, kv_fp8,
                              max_discard)
        # (with the model's MTP modules: a cache for the first, and its own lengths)
        self.mtp = len(net.mtp) > 0
        self.caches = allocate_caches(c, self.spec, net.dtype, self.device, mtp=int(self.mtp))
        self.mtp_lengths = [0] * max_seqs
        # Blocks are handed out in reverse order inside each slot's range so that a test of
        # the paging cannot pass by accident on identity tables.
        def tables(n_per: int) -> torch.Tensor:
            base = torch.arange(max_seqs)[:, None] * n_per
            return (base + torch.arange(n_per - 1, -1, -1)[None, :]).to(torch.int32).to(self.device)

        self.window_tables, self.csa_tables, self.hca_tables = tables(self.nw), tables(self.nc), tables(self.nh)
        self.lengths = [0] * max_seqs
        self.last_step = [0] * max_seqs  # each slot's tokens in its last step (discard's bound)
        self.host_tables = {k: getattr(self, f"{k}_tables").tolist()
                            for k in ("window", "csa", "hca")}
        self.graphs = DecodeGraphs(net, self.caches, self.device) if decode_graphs else None

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0
        self.last_step[slot] = 0
        self.mtp_lengths[slot] = 0

    def _batch(self, slots: list[int], feeds: dict[int, list[int]],
               lengths: list[int]) -> tuple[ForwardBatch, list[int]]:
        """The ForwardBatch of new tokens (feeds: slot -> ids) at each slot's `lengths`, and the
        row offsets."""
        pos, cu, ctx = [], [0], []
        for s in slots:
            n = len(feeds[s])
            pos += range(lengths[s], lengths[s] + n)
            cu.append(cu[-1] + n)
            ctx.append(lengths[s])
        ids = [t for s in slots for t in feeds[s]]
        sel = torch.tensor(slots, device=self.device)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(pos, dtype=torch.int64, device=self.device),
            cu_seqlens=cu, context_lens=ctx,
            window_tables=self.window_tables[sel], csa_tables=self.csa_tables[sel],
            hca_tables=self.hca_tables[sel], state_slots=slots)
        return batch, cu

    def mtp_step(self, feeds: dict[int, tuple[torch.Tensor, list[int]]]
                 ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """One step of the model's first MTP module: feeds maps slot -> (streams [n, N, D] at
        the slot's next n MTP positions - the main model's last streams there, or the module's
        own from the step before - and the n tokens one position on). Returns slot ->
        (logits [n, V] float32 predicting two positions on, the output streams [n, N, D])."""
        if not self.mtp:
            raise RuntimeError("mtp_step: the model was loaded without its MTP modules "
                               "(load(..., mtp=True))")
        slots = list(feeds)
        for s in slots:
            st, nxt = feeds[s]
            if st.shape[0] != len(nxt) or not len(nxt):
                raise ValueError(f"slot {s}: mtp_step takes as many streams as next tokens "
                                 f"(>= 1), got {st.shape[0]} and {len(nxt)}")
            if self.mtp_lengths[s] + len(nxt) > self.max_len:
                raise ValueError(f"slot {s}: {self.mtp_lengths[s] + len(nxt)} MTP positions "
                                 f"exceed max_len={self.max_len}")
        batch, cu = self._batch(slots, {s: list(feeds[s][1]) for s in slots}, self.mtp_lengths)
        streams = torch.cat([feeds[s][0] for s in slots]).to(self.net.dtype)
        logits, out = self.net.mtp_forward(streams, batch.input_ids, batch,
                                           self.caches[self.net.config.num_hidden_layers])
        for s in slots:
            self.mtp_lengths[s] += len(feeds[s][1])
        return {s: (logits[cu[i]:cu[i + 1]], out[cu[i]:cu[i + 1]]) for i, s in enumerate(slots)}

    def discard(self, slot: int, n: int) -> None:
        """Take back the last n tokens of a slot's last step (speculative drafts the model did
        not confirm): only its length shrinks; the next step writes over them (the caches'
        rings keep what the kept tokens need, CompressorState)."""
        most = min(self.spec.max_discard, self.last_step[slot])
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= most:
            raise ValueError(f"slot {slot}: can discard 0 .. {most} tokens (its last step's, at "
                             f"most max_discard={self.spec.max_discard}), got {n!r}")
        self.lengths[slot] -= n
        self.last_step[slot] -= n

    def step(self, feeds: dict[int, list[int]], *, streams: dict | None = None
             ) -> dict[int, torch.Tensor]:
        """Run one forward over several sequences at once: feeds maps slot -> new token ids.
        Returns slot -> logits [len(new tokens), V] (float32). streams: a dict filled with
        slot -> the last layer's streams [len(new tokens), N, D] (the MTP module's input; the
        step then runs eagerly)."""
        slots = list(feeds)
        for s in slots:
            toks = feeds[s]
            if not toks:
                raise ValueError(f"slot {s}: no new tokens")
            if self.lengths[s] + len(toks) > self.max_len:
                raise ValueError(f"slot {s}: {self.lengths[s] + len(toks)} tokens exceed max_len={self.max_len}")
        ids = [t for s in slots for t in feeds[s]]
        q = len(ids) // len(slots)
        if (self.graphs is not None and streams is None and q - 1 <= self.spec.max_discard
                and all(len(feeds[s]) == q for s in slots) and self.graphs.takes(len(slots))):
            # as many new tokens each, past the first no more than the rings hold (a copy: the
            # graph's output is overwritten by its next step)
            tables = {k: [self.host_tables[k][s] for s in slots] for k in self.host_tables}
            ctx = [self.lengths[s] for s in slots]
            logits = self.graphs.run(ids, ctx, slots, tables, tokens=q).clone()
            cu = [0]
            for s in slots:
                cu.append(cu[-1] + q)
        else:
            batch, cu = self._batch(slots, feeds, self.lengths)
            out: list[torch.Tensor] = []
            logits = self.net(batch, self.caches, streams_out=out)
            if streams is not None:
                streams.update({s: out[0][cu[i]:cu[i + 1]] for i, s in enumerate(slots)})
        for s in slots:
            self.lengths[s] += len(feeds[s])
            self.last_step[s] = len(feeds[s])
        return {s: logits[cu[i]:cu[i + 1]] for i, s in enumerate(slots)}


class Model:
    """What zeroinfer.model.load returns: the graph plus a runner for scoring and greedy."""

    def __init__(self, net: DeepseekV4ForCausalLM, device: torch.device) -> None:
        self.net, self.device, self.config = net, device, net.config

    def runner(self, **kw) -> PagedRunner:
        return PagedRunner(self.net, device=self.device, **kw)

    def _check_ids(self, token_ids) -> list[int]:
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("token_ids must not be empty")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token_ids outside the vocabulary [0, {self.config.vocab_size}): {bad[:5]}")
        return ids

    def logits(self, token_ids, *, chunk_size: int | None = None) -> torch.Tensor:
        """Teacher-forced logits [T, vocab] (float32) through the cached, paged path; with
        chunk_size the prompt is prefilled in chunks of that many tokens."""
        ids = self._check_ids(token_ids)
        r = self.runner(max_seqs=1, max_len=len(ids))
        step = chunk_size or len(ids)
        out = [r.step({0: ids[i:i + step]})[0] for i in range(0, len(ids), step)]
        return torch.cat(out)

    def mtp_logits(self, token_ids) -> torch.Tensor:
        """Teacher-forced logits [T - 1, vocab] (float32) of the first MTP module (a model
        loaded with mtp=True): row t, from the main model's last streams at t and token t + 1,
        predicts token t + 2 (the last row a token past the input)."""
        ids = self._check_ids(token_ids)
        if len(ids) < 2:
            raise ValueError("mtp_logits: token_ids needs at least 2 tokens")
        r = self.runner(max_seqs=1, max_len=len(ids))
        streams: dict[int, torch.Tensor] = {}
        r.step({0: ids}, streams=streams)
        return r.mtp_step({0: (streams[0][:-1], ids[1:])})[0][0]

    def greedy(self, token_ids, max_new_tokens: int) -> list[int]:
        """Prefill, then one token at a time through the cache (on CUDA each step a CUDA
        graph's replay); returns the new tokens."""
        ids = self._check_ids(token_ids)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        r = self.runner(max_seqs=1, max_len=len(ids) + max_new_tokens,
                        decode_graphs=self.device.type == "cuda")
        nxt = int(r.step({0: ids})[0][-1].argmax())
        out = [nxt]
        while len(out) < max_new_tokens:
            nxt = int(r.step({0: [nxt]})[0][-1].argmax())
            out.append(nxt)
        return out
