"""Continuous batching over the paged caches, scheduling one round ahead.

schedule() builds the next round while the previous one may still be running on the device:
every capacity check counts the tokens already dispatched (Request.num_computed is advanced
when a row is scheduled, and Request.inflight counts sampled-but-uncommitted tokens), and a
decode row whose input token is still on the device carries `prev_row` — the sampling row of the
previous round that will produce it — so the runner's length-correction kernel can place it.

Policy: running decodes first (one token each, or under speculative decoding a verification
row: the input token and its drafts, engine/speculative.py), then unfinished prefills, then
admissions in arrival order, all under max_num_batched_tokens / max_num_seqs; prompts are
chunked to the remaining budget. When a row cannot get blocks the newest running request is
preempted (recompute: its cache is dropped and its known tokens are prefilled again later).

Releases are deferred: blocks of a finished, aborted or preempted request return to the free
lists only once the last round that may touch them is known to be complete on the device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from zeroinfer.engine.block_manager import BlockManager
from zeroinfer.engine.request import Request, Status
from zeroinfer.engine.speculative import SpeculativeConfig, accepted_prefix


@dataclass
class Row:
    req: Request
    start: int  # position of the row's first token (= tokens already in cache)
    token_ids: list[int]  # host-known ids; 0 where the id is still on the device
    prev_row: int = -1  # sampling row of the previous round that produces token_ids[0]
    sample: bool = False  # the row ends at the sequence's end: sample the next token
    all_logits: bool = False  # return logits of every token (prompt scoring)
    drafts: int = 0  # a verification row: token_ids[1:] are drafts, every position sampled
    room: int = 1  # tokens from `start` the request's blocks hold (>= num_tokens)
    # a pipelined verification row: its start and ids are on the device (the speculative
    # state), read back with the round's results (RoundResult.rows); token_ids are placeholders
    device: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_samples(self) -> int:
        """Tokens this row draws: one a position of a verification row, else one if it
        samples."""
        return self.num_tokens if self.drafts else int(self.sample)


@dataclass
class ScheduledBatch:
    round_id: int
    rows: list[Row]

    @property
    def sample_rows(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r.sample]

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


@dataclass
class RoundResult:
    """Host copies of what a round produced, one a draw: the sampling rows in order, each
    Row.num_samples draws."""

    tokens: list[int]
    # pipelined verification rows: row index -> (start, ids, drafts verified, drafts the device
    # proposed), from the device
    rows: dict[int, tuple[int, list[int], int, int]] = field(default_factory=dict)
    logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None
    prompt_logits: dict[int, object] = field(default_factory=dict)  # row index -> [n, V] tensor
    # a device drafter's drafts after each sampling row (the MTP module's; rounds built on the
    # host): row index -> drafts
    drafts: dict[int, list[int]] = field(default_factory=dict)
    # rounds built on the host, with the speculative state on the device: row index -> the
    # drafts the device found for the row's next row
    next_offered: dict[int, int] = field(default_factory=dict)


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, speculative: SpeculativeConfig | None = None) -> None:
        """speculative: decode rows verify drafts. `schedule` builds them from committed
        tokens (the round before committed); `schedule_pipelined` builds the round after one
        in flight from the device's speculative state."""
        self.blocks = blocks
        self.speculative = speculative
        self.num_drafted = self.num_accepted = 0  # drafts verified / kept, over all rounds
        self.num_pipelined = 0  # rounds scheduled while the one before was in flight
        # the most drafts a row of the last committed round had on offer, among the requests
        # that go on: a pipelined round verifies that many a row (its drafts are on the
        # device, unknown here), so that where the drafter finds nothing the rounds stay plain
        # decode rounds. A prompt row offers nothing itself, so it counts the drafts the
        # device found for its next row; a finished request's last rows are cut by its end, so
        # they do not count; and with no request running it is the configured count again, as
        # at the start (so that a new batch of requests is scheduled the same whatever the
        # last one left here).
        self.recent_drafts = speculative.num_draft_tokens if speculative else 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.round_id = 0
        self.pending_release: list[tuple[int, dict[str, list[int]], int | None]] = []
        self.round_done: Callable[[int, bool], bool] = lambda rid, wait: True
        self.num_preemptions = 0

    # --- requests ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Request) -> None:
        if req.finished:
            return
        self._finish(req, "abort")

    # --- scheduling -------------------------------------------------------------------------
    def schedule(self, prev: ScheduledBatch | None) -> ScheduledBatch:
        """The next round. `prev` is the launched, uncommitted round (async) or None."""
        self.reclaim(wait=False)
        rid = self.round_id = self.round_id + 1
        rows: list[Row] = []
        budget = self.max_num_batched_tokens
        prev_row_of = {}
        if prev is not None:
            for k, i in enumerate(prev.sample_rows):
                prev_row_of[id(prev.rows[i].req)] = k
        scheduled: set[int] = set()

        capacity = self.blocks.capacity

        def grow_or_preempt(req: Request, tokens: int) -> bool:
            if tokens <= capacity(req.blocks):  # most decode rows: no new block this round
                return True
            while not self.blocks.can_grow(req.blocks, tokens):
                if self.reclaim(wait=True):
                    continue
                victim = next((r for r in reversed(self.running)
                               if id(r) not in scheduled and r is not req), None)
                if victim is None:
                    return False
                self._preempt(victim)
            self.blocks.grow(req.blocks, tokens)
            return True

        # 1. decodes and unfinished prefills of running requests, oldest first (this loop runs
        # for every sequence every round: the host's share of a decode round, kept lean)
        for req in list(self.running):
            if len(rows) >= self.max_num_seqs or budget <= 0:
                break
            if req.status is not Status.RUNNING:
                continue
            pos = req.num_computed
            known = len(req.prompt_ids) + len(req.output_ids)
            if pos < known:  # prefill (first chunk admitted, or recompute), or a synchronous decode
                n = min(known - pos, budget)
                ids = [req.token_at(i) for i in range(pos, pos + n)]
                prev_row = -1
                if pos == known - 1 and req.drafter is not None and not req.inflight:
                    # a decode row of a speculating request: verify the drafter's guesses too
                    ids += req.drafter.propose(min(self._draft_room(req, pos), budget - 1))
                    n = len(ids)
            elif pos == known + req.inflight - 1:  # a decode row
                if self._will_finish(req):
                    continue
                if req.inflight == 1:  # its input token is still on the device
                    n, ids = 1, [0]
                    prev_row = prev_row_of.get(id(req), -1)
                    if prev_row < 0:
                        raise RuntimeError(f"request {req.request_id}: in-flight token has no "
                                           "source row")
                else:  # its input token is committed
                    n, ids, prev_row = 1, [req.token_at(pos)], -1
            else:  # waiting for the in-flight round to commit (nothing to feed yet)
                continue
            if not grow_or_preempt(req, self._reach(pos, n, known)):
                self._preempt(req)
                continue
            if req.status is not Status.RUNNING:
                continue
            scheduled.add(id(req))
            self._add_row(rows, req, pos, ids, prev_row)
            rows[-1].room = capacity(req.blocks) - pos
            budget -= n

        # 2. admissions in arrival order
        while self.waiting and budget > 0 and len(rows) < self.max_num_seqs:
            req = self.waiting[0]
            if req.finished:
                self.waiting.popleft()
                continue
            if req.inflight:  # preempted while a token was in flight: wait for its commit
                break
            pos, n = 0, min(req.num_known, budget)
            reach = self._reach(pos, n, req.num_known)
            if not self.blocks.can_grow(req.blocks, reach, need_slot=True):
                if self.reclaim(wait=True):
                    continue
                break
            self.waiting.popleft()
            self.blocks.grow(req.blocks, reach)
            req.slot = self.blocks.take_slot()
            req.status = Status.RUNNING
            req.num_computed = 0
            self.running.append(req)
            scheduled.add(id(req))
            self._add_row(rows, req, pos, [req.token_at(i) for i in range(n)], -1)
            budget -= n
        return ScheduledBatch(rid, rows)

    def schedule_pipelined(self, prev: ScheduledBatch, max_rows: int) -> ScheduledBatch | None:
        """Speculative decoding, the round after `prev` while `prev` is in flight: one
        verification row for every running request, its start and ids left on the device by
        prev's epilogue (SpeculativeState). None where this cannot be - a request waits to be
        admitted or is not in prev's sampling rows (a prefill, a barrier round's), a
        constrained request (its masks need its drafts on the host), blocks for the row's
        optimistic reach cannot be had without a preemption, or more rows than a graph class
        holds: then the caller commits prev first and schedules on the host (a barrier)."""
        if self.waiting:
            return None
        self.reclaim(wait=False)
        in_prev = {id(prev.rows[i].req) for i in prev.sample_rows}
        D = self.speculative.num_draft_tokens
        live = [r for r in self.running if r.status is Status.RUNNING]
        rows: list[Row] = []
        for req in live:
            if id(req) not in in_prev or req.inflight != 1 or req.matcher is not None:
                return None
            if self._will_finish(req):  # (prev's commit ends it)
                continue
            # Its committed tokens reach the bonus of the round before prev; prev emits at most
            # 1 + D, and this row spans 1 + D from there (the MTP drafter's chain D - 1 more:
            # lookahead). (Blocks taken for a round that then does not happen stay the
            # request's, for its next rows.)
            reach = req.num_known + D + 1 + self.speculative.lookahead
            if not self.blocks.can_grow(req.blocks, reach):
                return None
            self.blocks.grow(req.blocks, reach)
            rows.append(req)
        if not rows or len(rows) > max_rows:
            return None
        # the drafts count in the token budget, as in a round built on the host: as many a row
        # as len(rows) rows of 1 + d tokens fit (none fit: the host schedules the round)
        d = min(D, self.recent_drafts, self.max_num_batched_tokens // len(rows) - 1)
        if d < 0:
            return None
        self.round_id += 1
        self.num_pipelined += 1
        out = []
        for req in rows:
            out.append(Row(req, -1, [0] * (1 + d), -1, True, False, d, 1 + d, True))
            req.inflight += 1
        return ScheduledBatch(self.round_id, out)

    def _add_row(self, rows: list[Row], req: Request, pos: int, ids: list[int],
                 prev_row: int) -> None:
        end = pos + len(ids)
        total = len(req.prompt_ids) + len(req.output_ids) + req.inflight
        drafts = max(0, end - total)  # (a decode row's ids past the known tokens)
        sample = end - drafts == total and not req.want_prompt_logits
        rows.append(Row(req, pos, ids, prev_row, sample, req.want_prompt_logits, drafts))
        req.num_computed = end  # (a verification row's: optimistic, set right at commit)
        if sample:
            req.inflight += 1

    def _reach(self, pos: int, n: int, known: int) -> int:
        """The positions a row of n tokens at pos holds blocks for. Under speculation every
        decode row holds them for a full verification row, drafts or not (a round of
        verification rows runs in fixed shapes, one length for every row, the rows with fewer
        drafts padded with guesses that are never kept), and with the MTP drafter for its
        chain past the row (SpeculativeConfig.lookahead) - a last prompt chunk's too."""
        spec = self.speculative
        if spec is None:
            return pos + n
        if pos >= known - 1:
            more = 1 + spec.lookahead
        elif spec.method == "mtp" and pos + n == known:
            more = n + spec.num_draft_tokens - 1
        else:
            more = n
        return pos + max(n, min(more, self.max_model_len - pos))

    def _draft_room(self, req: Request, pos: int) -> int:
        """The drafts worth verifying for a decode row at `pos`: the configured number, but
        no more than the request may still emit past its next token (max_tokens,
        max_model_len)."""
        out_left = req.params.max_tokens - len(req.output_ids) - 1
        len_left = self.max_model_len - (pos + 2)
        return max(0, min(self.speculative.num_draft_tokens, out_left, len_left))

    def _will_finish(self, req: Request) -> bool:
        """The tokens already sampled end the request: don't feed another."""
        out = len(req.output_ids) + req.inflight
        return (out >= req.params.max_tokens
                or len(req.prompt_ids) + out >= self.max_model_len)

    # --- committing -------------------------------------------------------------------------
    def commit(self, batch: ScheduledBatch, result: RoundResult,
               on_token: Callable[[Request, int], str | None]) -> list[Request]:
        """Apply a completed round. on_token(req, token) returns a finish reason or None.
        Returns the requests that finished."""
        finished = []
        offered = None  # the most drafts a speculating row had on offer (recent_drafts)
        k = 0  # the row's first draw in the result
        for i in batch.sample_rows:
            row = batch.rows[i]
            req = row.req
            first, k = k, k + row.num_samples
            req.inflight -= 1
            if req.finished:
                continue  # aborted or finished meanwhile: the tokens are dropped
            # (a decode row: its tokens are the last known one and its drafts)
            decode = row.device or row.num_tokens == 1 + row.drafts
            emit = 1
            if row.drafts or row.device:  # the drafts the draws confirm, then the first draw
                start, drafts = row.start, row.token_ids[1:]  # that differs
                if row.device:  # (what the device ran: its start, ids and real drafts)
                    start, ids, n, _ = result.rows[i]
                    drafts = ids[1:1 + n]
                kept = accepted_prefix(drafts, result.tokens[first:k])
                # counted: the drafts the request had room for (a pipelined row verifies its
                # d whatever max_tokens / max_model_len leave; a host-built row has no more)
                verified = min(len(drafts), self._draft_room(req, start))
                self.num_drafted += verified
                req.num_drafted += verified
                emit = 1 + kept
                req.num_computed = start + emit  # the rejected drafts' K/V is stale
            out0 = len(req.output_ids)
            for j in range(first, first + emit):
                reason = self._append(req, result, j, on_token)
                if reason is not None:
                    self._finish(req, reason)
                    finished.append(req)
                    break
            if emit > 1:  # kept: the drafts that became tokens (none past a stop or the end)
                kept_tokens = len(req.output_ids) - out0 - 1
                self.num_accepted += kept_tokens
                req.num_accepted += kept_tokens
            if i in result.drafts and not req.finished:  # (after _append's extend)
                req.drafter.drafts = result.drafts[i]
            if req.drafter is not None and not req.finished:
                # a decode row's own offer; a prompt row's: what the device found for its next
                n = ((result.rows[i][3] if row.device else row.drafts) if decode
                     else result.next_offered.get(i))
                if n is not None:
                    offered = max(offered or 0, n)
        if offered is not None:
            self.recent_drafts = offered
        for i, logits in result.prompt_logits.items():
            req = batch.rows[i].req
            if req.finished:
                continue
            if batch.rows[i].start == 0:  # the first chunk - again after a preemption, whose
                req.prompt_logits.clear()  # recompute gives the chunks before it again
            req.prompt_logits.append(logits)
            if sum(t.shape[0] for t in req.prompt_logits) >= len(req.prompt_ids):
                self._finish(req, "length")
                finished.append(req)
        return finished

    def _append(self, req: Request, result: RoundResult, j: int,
                on_token: Callable[[Request, int], str | None]) -> str | None:
        """Commit draw j of the result to the request; returns why it finishes, or None."""
        tok = result.tokens[j]
        req.output_ids.append(tok)
        if req.drafter is not None:
            req.drafter.extend((tok,))
        if result.logprobs is not None and req.params.logprobs is not None:
            top = result.top[j][: req.params.logprobs] if result.top else []
            req.output_logprobs.append((result.logprobs[j], top))
        reason = on_token(req, tok)
        if reason is None and (len(req.output_ids) >= req.params.max_tokens
                               or req.num_known >= self.max_model_len):
            reason = "length"
        return reason

    # --- releases ---------------------------------------------------------------------------
    def _finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        self._defer_release(req)
        if not self.running and self.speculative is not None:
            self.recent_drafts = self.speculative.num_draft_tokens

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._defer_release(req)
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _defer_release(self, req: Request) -> None:
        if req.blocks or req.slot is not None:
            # The newest launched round may still use them (it was scheduled before we knew).
            self.pending_release.append((self.round_id, dict(req.blocks), req.slot))
        req.blocks = {}
        req.slot = None

    def reclaim(self, wait: bool) -> bool:
        """Release deferred blocks whose last round is complete; with wait=True block on the
        oldest pending round if nothing is free yet. True if anything was released."""
        freed = False
        keep = []
        for rid, blocks, slot in self.pending_release:
            if self.round_done(rid, False):
                self.blocks.release(blocks, slot)
                freed = True
            else:
                keep.append((rid, blocks, slot))
        self.pending_release = keep
        if not freed and wait and keep:
            rid = keep[0][0]
            self.round_done(rid, True)
            return self.reclaim(wait=False)
        return freed
