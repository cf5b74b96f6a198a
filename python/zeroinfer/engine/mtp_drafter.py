"""Speculative drafts from the model's first multi-token-prediction module, on the device.

The module at position t reads the main model's last streams at t and the token at t + 1 and
predicts the token at t + 2 (model/deepseek_v4.py, MTPLayer). It keeps a sliding-window cache
of its own (one more LayerCache, indexed by the window block tables the main layers use), which
must hold an entry for every position a later query's window reaches. So every round, after its
draws, the module runs over all of the round's tokens - prompt chunks too - each paired with the
token one position on: the next input of its row, or the draw made there (a verification row's
draws are the accepted drafts, then the bonus token). Entries past a row's accepted position are
junk that the next round writes again before any query can read them, as the main caches'.

Then, per sampling row, the greedy draft chain: the module's logits at the row's accepted
position give draft 1; each further draft is one more step of the module at the next position,
fed its own output streams and the draft before (DeepSeek's recursive use of one MTP module).
The drafts go to the device's speculative state (the next round reads them there when it is
pipelined) and, for rounds built on the host, back with the round's results.

Everything stays on the device (the accepted count is known only there): the chain's positions
and window-table rows are device tensors (a sliding-window block needs no host-side lengths).
A round in fixed shapes (a decode graph's class) drafts in that class's shapes too, every
padding row drafting into the scratch block: one CUDA graph a class on a GPU (`draft_fixed`;
captured on the round at hand - the module's writes are idempotent, unlike the compressors',
so the warm-up may run on real rows), the same padded form eagerly on the CPU.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.nn.functional as F

from zeroinfer.model.cache import ForwardBatch, LayerCache, pool_block_size
from zeroinfer.model.decode_graph import capture_graph
from zeroinfer.model.deepseek_v4 import DeepseekV4ForCausalLM


class _FixedDrafts:
    """A fixed-shape class's static inputs (next ids [rows * q], accepted token index [rows])
    and drafts [rows, D], and on a GPU its graph."""

    @torch.inference_mode(False)
    def __init__(self, rows: int, q: int, D: int, device: torch.device) -> None:
        i64 = dict(dtype=torch.int64, device=device)
        self.nxt = torch.zeros(rows * q, **i64)
        self.first = torch.arange(rows, **i64) * q  # each row's first token: a padding row's
        self.acc = self.first.clone()
        self.row_seq = torch.arange(rows, **i64)
        self.drafts = torch.zeros(rows, D, **i64)
        self.graph: torch.cuda.CUDAGraph | None = None


class MtpDrafter:
    def __init__(self, net: DeepseekV4ForCausalLM, cache: LayerCache, num_drafts: int) -> None:
        """net: a model with its MTP modules (LLMEngine checks); cache: the module's."""
        self.net, self.cache, self.D = net, cache, num_drafts
        # a fixed-shape step's buffers, dropped with the step (DecodeGraphs.reset makes new ones)
        self.fixed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.pool = None

    def draft_fixed(self, step, draws: torch.Tensor, draw_at: torch.Tensor | None,
                    kept: torch.Tensor) -> torch.Tensor:
        """`draft` for a round in a decode graph's fixed shapes (model/decode_graph.py
        FixedStep `step`, its batch and streams; every real row samples at each of its tokens):
        draws at the token indices draw_at (None: all of the first R rows' q tokens), kept [R]
        the rows' accepted drafts. Returns the R rows' drafts [R, D] (the class's output)."""
        f = self.fixed.get(step)
        fresh = f is None
        if fresh:
            f = self.fixed[step] = _FixedDrafts(step.rows, step.tokens, self.D, draws.device)
        R = kept.shape[0]
        f.nxt.zero_()
        if draw_at is None:
            f.nxt[:draws.shape[0]] = draws
        else:
            f.nxt[draw_at] = draws
        f.acc.copy_(f.first)
        f.acc[:R] += kept
        if draws.device.type != "cuda":
            self._draft_into(step, f)
        elif fresh:
            self._capture(step, f)
        else:
            f.graph.replay()
        return f.drafts[:R]

    def _draft_into(self, step, f: _FixedDrafts) -> None:
        f.drafts.copy_(self.draft(step.batch(), step.streams, f.nxt, f.acc, f.row_seq))

    def _capture(self, step, f: _FixedDrafts) -> None:
        """Capture the class's drafts; the warm-up runs them on this round's rows, which the
        drafts need anyway."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        f.graph, _ = capture_graph(lambda: self._draft_into(step, f), f.nxt.device, self.pool,
                                   what=f"mtp drafts {step.key}")

    @torch.inference_mode()
    def draft(self, batch: ForwardBatch, streams: torch.Tensor, next_ids: torch.Tensor,
              accepted: torch.Tensor | None, row_seq: torch.Tensor | None) -> torch.Tensor | None:
        """The round's MTP pass and its rows' drafts. batch: the round's forward batch (its
        positions, rows and window tables); streams [T, N, D]: the main model's last streams of
        its tokens; next_ids [T]: each token's next token (see the module doc). accepted [R]:
        the token index (in batch order) of each sampling row's accepted position, and row_seq
        [R] its sequence index in the batch; None when the round samples nothing. Returns the
        drafts [R, D] int64 (greedy), or None."""
        mtp_batch = dataclasses.replace(batch, input_ids=next_ids)  # (its own derived values)
        logits, out = self.net.mtp_forward(streams, next_ids, mtp_batch, self.cache,
                                           logits_rows=accepted)
        if accepted is None:
            return None
        drafts = [logits.argmax(-1)]
        R = accepted.shape[0]
        h = out[accepted]
        dev = next_ids.device
        # The scheduler holds blocks for the chain's positions (SpeculativeConfig.lookahead),
        # but not past max_model_len: there the chain writes and reads the pool's scratch block
        # (only those drafts' quality suffers; no entry of a sequence is touched).
        B = pool_block_size(self.cache.window)
        tables = F.pad(batch.window_tables[row_seq], (0, -(-self.D // B) + 1), value=-1)
        cols = torch.arange(tables.shape[1], device=dev)
        held = torch.where(tables >= 0, cols, -1).amax(1, keepdim=True)
        scratch = self.cache.window.shape[0] - 1
        tables = torch.where(cols[None] > held, scratch, tables).to(torch.int32)
        pos = batch.positions[accepted]
        chain = dict(cu_seqlens=list(range(R + 1)), context_lens=[0] * R, window_tables=tables,
                     csa_tables=batch.csa_tables[row_seq], hca_tables=batch.hca_tables[row_seq],
                     state_slots=[0] * R, seq=torch.arange(R, device=dev))
        for i in range(1, self.D):
            prev = drafts[-1]
            step = ForwardBatch(input_ids=prev, positions=pos + i, **chain)
            logits, h = self.net.mtp_forward(h, prev, step, self.cache)
            drafts.append(logits.argmax(-1))
        return torch.stack(drafts, dim=1)
