"""ModelRunner: ScheduledBatch -> device tensors -> length correction -> model -> sampler.

launch() never waits for the device: on CUDA it enqueues kernels on the current stream and
records an event; on CPU the same work is handed to `EmulatedDevice`, an in-order worker thread
that completes rounds one after another and sets an event per round, so the one-round-ahead
pipeline runs the same code paths in CI as on a GPU. The host reads a round's results only
through RoundHandle.result(), after the round's event.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from zeroinfer import ops
from zeroinfer.engine.mtp_drafter import MtpDrafter
from zeroinfer.engine.scheduler import RoundResult, ScheduledBatch
from zeroinfer.engine.spec_state import SpeculativeState
from zeroinfer.model.cache import ForwardBatch, LayerCache, host_tensor
from zeroinfer.model.decode_graph import DecodeGraphs
from zeroinfer.model.deepseek_v4 import DeepseekV4ForCausalLM
from zeroinfer.sampling.sampler import SamplingBatch, sample

KINDS = ("window", "csa", "hca")


class EmulatedDevice:
    """An in-order 'device' for CPU runs: one worker thread executing submitted work in order.

    The thread is joined at interpreter exit if no one closed it: a daemon thread still inside
    torch when the interpreter finalises (it may be freeing a round's tensors just after
    signalling the round done) is ended by a forced unwind that aborts the process
    ("terminate called without an active exception")."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="zeroinfer-device", daemon=True)
        self.thread.start()
        atexit.register(self.close)

    def _loop(self) -> None:
        while True:
            fn = self.q.get()
            if fn is None:
                return
            fn()

    def submit(self, fn: Callable[[], None]) -> None:
        self.q.put(fn)

    def close(self) -> None:
        atexit.unregister(self.close)
        self.q.put(None)
        self.thread.join()


class RoundHandle:
    """One launched round: its device outputs and the event that says they are complete."""

    def __init__(self, batch: ScheduledBatch, cuda: bool) -> None:
        self.batch = batch
        self.cuda = cuda
        self.event = torch.cuda.Event() if cuda else threading.Event()
        self.error: BaseException | None = None
        self.tokens: torch.Tensor | None = None  # device [S] int64: next-round inputs come from here
        self.host: dict[str, torch.Tensor] = {}
        self.prompt_logits: dict[int, torch.Tensor] = {}
        self.span: tuple | None = None  # device-side (start, end) marks when timing is on
        self.deferred: tuple | None = None  # (host inputs, logits, start): sampling to launch

    def device_interval(self) -> tuple[float, float] | None:
        """(start, end) of this round's device work in seconds on a common clock (CUDA: relative
        to the first round's start event, filled by ModelRunner.timeline)."""
        return self.span

    def done(self) -> bool:
        return self.event.query() if self.cuda else self.event.is_set()

    def wait(self) -> None:
        if self.cuda:
            self.event.synchronize()
        else:
            self.event.wait()
        if self.error is not None:
            raise self.error

    def result(self) -> RoundResult:
        self.wait()
        h = self.host
        if "tokens" not in h:
            return RoundResult(tokens=[], prompt_logits=self.prompt_logits)
        top = None
        if "top_ids" in h:
            top = [list(zip(i, p)) for i, p in zip(h["top_ids"].tolist(), h["top_logprobs"].tolist())]
        rows = {}
        if "row_start" in h:  # a pipelined round: every row's start, ids and drafts
            rows = {i: row for i, row in enumerate(zip(
                h["row_start"].tolist(), h["row_ids"].tolist(), h["row_drafts"].tolist(),
                h["row_offered"].tolist()))}
        drafts = {}
        if "mtp_drafts" in h:  # the MTP drafter's, for each sampling row's next row
            drafts = dict(zip(self.batch.sample_rows, h["mtp_drafts"].tolist()))
        next_offered = {}
        if "next_offered" in h:  # a round built on the host: the drafts each next row has
            next_offered = dict(zip(self.batch.sample_rows, h["next_offered"].tolist()))
        return RoundResult(tokens=h["tokens"].tolist(), rows=rows, logprobs=h["logprob"].tolist(),
                           top=top, prompt_logits=self.prompt_logits, drafts=drafts,
                           next_offered=next_offered)


@contextmanager
def forbid_host_sync(enabled: bool):
    """Make any torch-visible host synchronisation inside the launch path raise (CUDA only)."""
    if not enabled:
        yield
        return
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


class HostBlockTables:
    """The block tables of every state slot, mirrored in one host tensor per kind, so that a
    round's tables are one index_select of its rows' slots, not a list built per row per round.
    A slot's row follows its request's block list: entries are written only where the list grew
    (a decode row gains a block once in a block's worth of steps) or, when the slot holds a new
    list (another request, or a request's blocks after a preemption), the row is rewritten. Past
    a row's length every entry is -1, as the kernels' padding expects."""

    def __init__(self) -> None:
        self.rows = {k: torch.full((1, 16), -1, dtype=torch.int32) for k in KINDS}
        # per kind and slot: the list object the row mirrors, and how much of it is written
        self.src: dict[str, dict[int, object]] = {k: {} for k in KINDS}
        self.done: dict[str, dict[int, int]] = {k: {} for k in KINDS}

    def tables(self, rows) -> dict[str, torch.Tensor]:
        """{kind: int32 [len(rows), max(1, longest table)]} for the batch rows (CPU)."""
        slots = [r.req.slot for r in rows]
        need = max(slots, default=0) + 1
        out = {}
        for k in KINDS:
            width = 1
            for r in rows:
                # () for a kind the request holds no block of yet: a shared empty that still
                # clears what the slot's last owner left
                blocks = r.req.blocks.get(k, ())
                width = max(width, len(blocks))
                self._sync(k, r.req.slot, blocks)
            t = self.rows[k]
            if t.shape[0] < need or t.shape[1] < width:  # rows for new slots, wider rows
                grown = torch.full((max(need, 2 * t.shape[0]), max(width, 2 * t.shape[1])), -1,
                                   dtype=torch.int32)
                grown[:t.shape[0], :t.shape[1]] = t
                self.rows[k] = t = grown
                for slot, blocks in self.src[k].items():  # (written before the growth)
                    t[slot, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
                    self.done[k][slot] = len(blocks)
            out[k] = t[:, :width].index_select(0, torch.tensor(slots, dtype=torch.long))
        return out

    def _sync(self, kind: str, slot: int, blocks) -> None:
        t, src, done = self.rows[kind], self.src[kind], self.done[kind]
        have = done.get(slot, 0) if src.get(slot) is blocks else -1
        if have == len(blocks):
            return
        src[slot] = blocks
        if slot >= t.shape[0] or len(blocks) > t.shape[1]:
            done[slot] = 0  # tables() grows the tensor and writes every mirrored row
            return
        if have < 0:  # a new list in this slot: clear what the last one left
            t[slot].fill_(-1)
            have = 0
        if len(blocks) > have:
            t[slot, have:len(blocks)] = torch.tensor(blocks[have:], dtype=torch.int32)
        done[slot] = len(blocks)


class ModelRunner:
    def __init__(self, net: DeepseekV4ForCausalLM, caches: list[LayerCache], device: torch.device,
                 *, forbid_sync: bool = False, decode_graphs: bool = False,
                 speculative=None, max_len: int = 0, slots: int = 0) -> None:
        """speculative (a SpeculativeConfig): keep the per-slot speculative state on the device
        (`slots` sequences of up to `max_len` positions), so rounds can be pipelined."""
        self.net, self.caches, self.device = net, caches, device
        self.spec_state = (SpeculativeState(slots, max_len, speculative, device,
                                            fixed_shapes=decode_graphs)
                           if speculative is not None else None)
        # the MTP drafter: its cache is the one past the main layers'
        self.mtp = (MtpDrafter(net, caches[net.config.num_hidden_layers],
                               speculative.num_draft_tokens)
                    if speculative is not None and speculative.method == "mtp" else None)
        self.graphs = DecodeGraphs(net, caches, device) if decode_graphs else None
        self.cuda = device.type == "cuda"
        self.forbid_sync = forbid_sync and self.cuda
        self.emulated = None if self.cuda else EmulatedDevice()
        self.timing = False  # record each round's device start/end (bench: idle gaps)
        self.block_tables = HostBlockTables()
        self.grammars = None  # structured output's GrammarBackend, once a request needs it
        # rounds replayed in fixed shapes (an expert-parallel rank's idle ones too), by row length
        self.graph_rounds: dict[int, int] = {}

    def close(self) -> None:
        if self.emulated is not None:
            self.emulated.close()
            self.emulated = None

    def run_idle(self, graph_rows: int | None, tokens: int = 1) -> None:
        """Expert parallelism, a round this rank has no sequences for: serve the others' tokens
        in every MoE layer - a decode graph of padding alone in the group's class (rows, tokens
        a row), or an eager idle forward."""
        if graph_rows is None:
            self.run_in_order(self.net.idle_forward)
        else:
            empty = {k: [] for k in KINDS}
            self.graph_rounds[tokens] = self.graph_rounds.get(tokens, 0) + 1
            self.run_in_order(lambda: self.graphs.run([], [], [], empty, rows=graph_rows,
                                                      tokens=tokens))

    def run_in_order(self, fn: Callable[[], object]) -> None:
        """Run device work that is not a round (an expert-parallel rank's idle forward, an
        expert rebalance) after every launched round: on CUDA enqueued now, in stream order; on
        the CPU on the emulated device's thread, waited for (errors raised here)."""
        if self.emulated is None:
            with torch.inference_mode():
                fn()
            return
        handle = RoundHandle(None, False)

        def work() -> None:
            try:
                with torch.inference_mode():
                    fn()
            except BaseException as e:
                handle.error = e
            finally:
                handle.event.set()

        self.emulated.submit(work)
        handle.wait()

    # --- host side: build inputs ------------------------------------------------------------
    def _allowed(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Structured output: the round's draws' token bitmask from their requests' matchers
        (on the host: the matchers follow the commits, which run on this thread; a
        verification row's masks follow its drafts), or None."""
        rows = [batch.rows[i] for i in batch.sample_rows]
        matchers = [None if r.req.matcher is None or r.req.matcher.is_terminated()
                    else r.req.matcher for r in rows]
        if all(m is None for m in matchers):
            return None
        return self.grammars.token_bitmask(
            matchers, [r.token_ids[1:] if r.drafts else [] for r in rows])

    def _host_inputs(self, batch: ScheduledBatch, masks: bool = True) -> dict:
        rows = batch.rows
        ids, pos, cu, remap = [], [], [0], []
        for r in rows:
            ids += r.token_ids
            pos += range(r.start, r.start + r.num_tokens)
            cu.append(cu[-1] + r.num_tokens)
            remap.append(r.prev_row)
        tables = self.block_tables.tables(rows)
        logits_rows = []
        for i, r in enumerate(rows):
            if r.all_logits or r.drafts:  # (a verification row draws at every position)
                logits_rows += range(cu[i], cu[i + 1])
            elif r.sample:
                logits_rows.append(cu[i + 1] - 1)
        # one draw a sampling row, a verification row's one a position: each at the position
        # of the token it draws
        reqs, spos = [], []
        for i in batch.sample_rows:
            r = rows[i]
            reqs += [r.req] * r.num_samples
            spos += range(r.start + r.num_tokens - r.num_samples + 1, r.start + r.num_tokens + 1)
        allowed = self._allowed(batch) if masks else None  # (else launch_sampling's)
        return dict(ids=ids, pos=pos, cu=cu, remap=remap, tables=tables,
                    ctx=[r.start for r in rows], slots=[r.req.slot for r in rows],
                    logits_rows=logits_rows,
                    sampling=([q.params for q in reqs], [q.seed for q in reqs], spos, allowed))

    def _tensor(self, data, dtype) -> torch.Tensor:
        return host_tensor(data, self.device, dtype)

    def graph_rows(self, batch: ScheduledBatch, tokens: int | None = None) -> int | None:
        """The rows of a round that can replay a decode graph (every row a decode row - one
        token, or a verification row's - each sampled, with room for `tokens` a row, by
        default its longest row's; a class for that many rows), else None."""
        rows = batch.rows
        if self.graphs is None or not self.graphs.takes(len(rows)):
            return None
        q = tokens or self.graph_tokens(batch)
        if not all(r.sample and not r.all_logits and r.num_tokens == 1 + r.drafts
                   and r.room >= q for r in rows):
            return None
        return len(rows)

    @staticmethod
    def graph_tokens(batch: ScheduledBatch) -> int:
        """The tokens a row of the round's fixed-shape form: its longest row's (verification
        rows with fewer drafts are padded with guesses that are never kept)."""
        return max(r.num_tokens for r in batch.rows)

    # --- device side ------------------------------------------------------------------------
    def launch(self, batch: ScheduledBatch, prev: RoundHandle | None, *,
               graph: bool | int = True, tokens: int | None = None,
               defer_sampling: bool = False) -> RoundHandle:
        """Enqueue the round; returns at once (no host synchronisation). graph: True to replay
        a decode graph where the round allows (graph_rows), False to run it eagerly, or the
        row class to replay it in (>= its rows; expert parallelism: the group's choice), its
        rows `tokens` long (default: the longest row's; the rows must have room for it).
        defer_sampling: enqueue the forward alone; `launch_sampling` enqueues the sampling
        later (structured output: once the previous round's tokens are committed, the
        matchers give the masks). The round is complete only after that."""
        handle = RoundHandle(batch, self.cuda)
        host = self._host_inputs(batch, masks=not defer_sampling)
        if graph is True:
            host["graph"] = self.graph_rows(batch)
        else:
            host["graph"] = graph or None
        host["tokens"] = tokens or (self.graph_tokens(batch) if batch.rows else 1)
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True) if self.timing else None
            if start is not None:
                start.record()
            with forbid_host_sync(self.forbid_sync):
                logits = self._run(handle, host, prev)
            if defer_sampling:
                handle.deferred = (host, logits, start)
                return handle
            self._finish_cuda(handle, host, logits, start)
        else:
            def work() -> None:
                t0 = time.perf_counter()
                try:
                    logits = self._run(handle, host, prev)
                    if defer_sampling:
                        handle.deferred = (host, logits, t0)
                        return
                    self._sample(handle, host, logits)
                except BaseException as e:  # surfaced by RoundHandle.wait on the host
                    handle.error = e
                    if defer_sampling:  # (launch_sampling's work completes the round)
                        return
                self._finish_emulated(handle, t0)

            self.emulated.submit(work)
        return handle

    def launch_sampling(self, handle: RoundHandle) -> None:
        """The sampling of a round launched with defer_sampling (its forward enqueued before):
        the structured-output masks from the matchers as they are now, then the draw."""
        batch = handle.batch
        allowed = self._allowed(batch)
        if self.cuda:
            host, logits, start = handle.deferred
            handle.deferred = None
            host["sampling"] = (*host["sampling"][:3], allowed)
            with forbid_host_sync(self.forbid_sync):
                self._finish_cuda(handle, host, logits, start)
            return

        def work() -> None:
            if handle.deferred is None:  # (the forward failed: handle.error says why)
                self._finish_emulated(handle, None)
                return
            host, logits, t0 = handle.deferred
            handle.deferred = None
            try:
                host["sampling"] = (*host["sampling"][:3], allowed)
                self._sample(handle, host, logits)
            except BaseException as e:
                handle.error = e
            self._finish_emulated(handle, t0)

        self.emulated.submit(work)

    def _finish_cuda(self, handle: RoundHandle, host: dict, logits, start) -> None:
        self._sample(handle, host, logits)
        handle.event.record()
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            handle.span = (start, end)

    def _finish_emulated(self, handle: RoundHandle, t0: float | None) -> None:
        if self.timing and t0 is not None:
            handle.span = (t0, time.perf_counter())
        handle.event.set()

    def _run(self, handle: RoundHandle, host: dict, prev: RoundHandle | None) -> torch.Tensor:
        """The round's forward: its logits rows (see _logits_order)."""
        i32, i64 = torch.int32, torch.int64
        input_ids = self._tensor(host["ids"], i32)
        positions = self._tensor(host["pos"], i32)
        if prev is not None and any(p >= 0 for p in host["remap"]):
            # The zero-overhead fix-up: take each continuing row's input token from the previous
            # round's samples, on the device. (No speculative tokens yet: one token per row,
            # every in-flight token accepted, so lengths and positions stay as scheduled.)
            R, S = len(host["remap"]), prev.tokens.shape[0]
            ones_prev = torch.ones(S, dtype=i32, device=self.device)
            cu = self._tensor(host["cu"], i32)
            fixed = ops.correct_lengths(
                self._tensor(host["remap"], i32), ones_prev, prev.tokens.to(i32).view(S, 1),
                ones_prev, torch.ones(R, dtype=i32, device=self.device), cu,
                cu[1:] - cu[:-1] + self._tensor(host["ctx"], i32), positions, input_ids)
            input_ids, positions = fixed.input_ids, fixed.positions
        batch = handle.batch
        q = host["tokens"]
        if host["graph"] is not None:
            self.graph_rounds[q] = self.graph_rounds.get(q, 0) + 1
        if batch.rows and batch.rows[0].device:
            return self._run_pipelined(host)
        if self.spec_state is not None:
            self._spec_inputs(batch, host, input_ids, positions)
        if host["graph"] is not None and q > 1:
            # verification rows (synchronous: the ids are the host's), each padded to q tokens
            # with guesses (0) that are never kept; the draws read the real tokens' logits
            ids = [t for r in batch.rows for t in r.token_ids + [0] * (q - r.num_tokens)]
            logits = self.graphs.run(ids, host["ctx"], host["slots"], host["tables"],
                                     rows=host["graph"], tokens=q)
            host["pick"] = [i * q + j for i, r in enumerate(batch.rows)
                            for j in range(r.num_tokens)]
            self._keep_mtp_input(host, q)
        elif host["graph"] is not None:
            # a decode round: one token a row, each sampled (model/decode_graph.py)
            logits = self.graphs.run(input_ids, host["ctx"], host["slots"], host["tables"],
                                     rows=host["graph"])
            self._keep_mtp_input(host, 1)
        else:  # every round runs the forward: prompt chunks that sample nothing fill the caches
            fb = ForwardBatch(
                input_ids=input_ids.to(i64), positions=positions.to(i64), cu_seqlens=host["cu"],
                context_lens=host["ctx"],
                window_tables=self._tensor(host["tables"]["window"], i32),
                csa_tables=self._tensor(host["tables"]["csa"], i32),
                hca_tables=self._tensor(host["tables"]["hca"], i32), state_slots=host["slots"],
                seq=self._tensor([i for i, r in enumerate(batch.rows)
                                  for _ in range(r.num_tokens)], i64))
            out: list[torch.Tensor] = []
            logits = self.net(fb, self.caches, logits_rows=self._tensor(host["logits_rows"], i64),
                              streams_out=out if self.mtp is not None else None)
            if self.mtp is not None:
                host["mtp_in"] = (fb, out[0], None)
        return logits

    def _keep_mtp_input(self, host: dict, q: int) -> None:
        """A fixed-shape round's batch and last streams for the MTP drafter (rows of q tokens
        in the step's padded layout)."""
        if self.mtp is not None:
            step = self.graphs.last
            host["mtp_in"] = (step, step.streams, q)

    def _run_pipelined(self, host: dict) -> torch.Tensor:
        """A pipelined round of verification rows (speculative decoding, every row's start and
        ids on the device, in SpeculativeState): in fixed shapes, q tokens a row (the
        scheduler's choice; a row's drafts past q - 1 are not verified, and past its drafts
        the tokens are junk that is never kept)."""
        st, i64 = self.spec_state, torch.int64
        q = host["tokens"]
        if host["graph"] is None or q > 1 + st.D:
            raise RuntimeError("a pipelined round runs in fixed shapes of verification rows")
        sl = self._tensor(host["slots"], i64)
        ctx = st.length[sl] - 1
        ids = st.next_ids[sl][:, :q]
        # (no history write: the bonus at ctx is there from the epilogue before, and the
        # drafts the draws confirm are written by this round's)
        pos = ctx[:, None] + torch.arange(q, device=self.device)
        logits = self.graphs.run(ids.reshape(-1), ctx, host["slots"], host["tables"],
                                 rows=host["graph"], tokens=q)
        self._keep_mtp_input(host, q)
        params, seeds, _, allowed = host["sampling"]
        host["sampling"] = (params, seeds, (pos + 1).reshape(-1), allowed)
        offered = st.drafts[sl]  # (a copy: the epilogue writes the next round's)
        host["spec_rows"] = (sl, ctx, ids, offered.clamp(max=q - 1), None)
        host["offered"] = offered
        return logits

    def _spec_inputs(self, batch: ScheduledBatch, host: dict, input_ids: torch.Tensor,
                     positions: torch.Tensor) -> None:
        """Speculative decoding, a round built on the host: its tokens into the device
        history, and its sampling rows as the epilogue takes them (SpeculativeState.advance:
        each row from its first sampled position, its ids from there, its real drafts)."""
        i64 = torch.int64
        rows = batch.rows
        # the slots as launched (host["slots"]), not the requests': on the CPU this runs on the
        # emulated device after launch returned, and an abort meanwhile has released the slot
        host_slots = host["slots"]
        slots = [s for s, r in zip(host_slots, rows) for _ in range(r.num_tokens)]
        self.spec_state.write(self._tensor(slots, i64), positions.to(i64), input_ids.to(i64))
        sample = [rows[i] for i in batch.sample_rows]
        if not sample:
            return
        q = max(r.num_samples for r in sample)
        ctx, ids, drafts, draw_at, k = [], [], [], [], 0
        for r in sample:
            m = r.num_samples
            ctx.append(r.start + r.num_tokens - m)
            ids.append(r.token_ids[r.num_tokens - m:] + [0] * (q - m))
            drafts.append(r.drafts)
            draw_at.append([k + min(j, m - 1) for j in range(q)])
            k += m
        host["spec_rows"] = (self._tensor([host_slots[i] for i in batch.sample_rows], i64),
                             self._tensor(ctx, i64), self._tensor(ids, i64),
                             self._tensor(drafts, i64), self._tensor(draw_at, i64))

    def _sample(self, handle: RoundHandle, host: dict, logits: torch.Tensor) -> None:
        """The round's prompt logits to the host, and its sampling rows drawn."""
        i64 = torch.int64
        batch = handle.batch
        n_sample = len(batch.sample_rows)
        offset = 0
        for i, r in enumerate(batch.rows):  # the logits rows in row order (_logits_order)
            if r.all_logits:
                handle.prompt_logits[i] = self._to_host(logits[offset: offset + r.num_tokens])
                offset += r.num_tokens
            elif r.sample:
                offset += r.num_samples
        if n_sample:
            sample_idx = host.get("pick") or [
                k for k, i in enumerate(self._logits_order(batch)) if batch.rows[i].sample]
            params, seeds, spos, allowed = host["sampling"]
            sb = SamplingBatch.build(params, seeds, spos, self.device, allowed)
            res = sample(logits[self._tensor(sample_idx, i64)] if len(sample_idx) != logits.shape[0]
                         else logits, sb)
            handle.tokens = res.tokens
            if "spec_rows" in host:  # speculative state: the rows' kept drafts, next drafts
                sl, ctx, ids, drafts, draw_at = host["spec_rows"]
                draws = (res.tokens.view(ids.shape) if draw_at is None
                         else res.tokens[draw_at])
                kept = self.spec_state.advance(sl, ctx, ids, drafts, draws)
                if self.mtp is not None:
                    self._mtp_round(handle, host, res.tokens, kept)
                if draw_at is None:  # (pipelined: the host learns what the device ran)
                    handle.host["row_start"] = self._to_host(ctx)
                    handle.host["row_ids"] = self._to_host(ids)
                    handle.host["row_drafts"] = self._to_host(drafts)
                    handle.host["row_offered"] = self._to_host(host["offered"])
                else:  # (built on the host: the drafts the device found for each row's next
                    # row, which the commit of a prompt row counts - Scheduler.recent_drafts)
                    handle.host["next_offered"] = self._to_host(self.spec_state.drafts[sl])
            handle.host["tokens"] = self._to_host(res.tokens)
            handle.host["logprob"] = self._to_host(res.logprob)
            if getattr(res, "top_ids", None) is not None:
                handle.host["top_ids"] = self._to_host(res.top_ids)
                handle.host["top_logprobs"] = self._to_host(res.top_logprobs)
        elif self.mtp is not None and "mtp_in" in host:  # (prompt chunks: the MTP cache)
            self._mtp_round(handle, host, None, None)

    def _mtp_round(self, handle: RoundHandle, host: dict, draws: torch.Tensor | None,
                   kept: torch.Tensor | None) -> None:
        """The MTP drafter over the round (engine/mtp_drafter.py): each token paired with the
        next one - its row's next input, or the draw made at its position - and, per sampling
        row, the chain of drafts from its accepted position, into the speculative state (and,
        for a round built on the host, back to the host with the results)."""
        i64 = torch.int64
        fb, streams, q = host.pop("mtp_in")
        rows = handle.batch.rows
        pipelined = bool(rows) and rows[0].device
        if q is not None:  # a fixed-shape round (fb: its FixedStep): each row draws at q
            draw_at = None if pipelined else self._tensor(  # (or its n <= q) positions
                [i * q + j for i, r in enumerate(rows) for j in range(r.num_tokens)], i64)
            drafts = self.mtp.draft_fixed(fb, draws, draw_at, kept)
        else:
            shift, draw_at, first, base = [], [], [], 0
            for r in rows:  # (fb: the eager forward's batch, the rows one after another)
                n, end = r.num_tokens, r.start + r.num_tokens
                # the token after the row's last: the prompt's (a chunk), else drawn here
                shift += r.token_ids[1:] + [r.req.token_at(end) if end < r.req.num_known else 0]
                if r.sample:
                    m = r.num_samples
                    draw_at += range(base + n - m, base + n)
                    first.append(base + n - m)
                base += n
            nxt = self._tensor(shift, i64)
            if draw_at:
                nxt[self._tensor(draw_at, i64)] = draws
            if kept is None:  # (nothing drawn: the prompt chunks' entries only)
                self.mtp.draft(fb, streams, nxt, None, None)
                return
            drafts = self.mtp.draft(fb, streams, nxt, self._tensor(first, i64) + kept,
                                    self._tensor(list(handle.batch.sample_rows), i64))
        self.spec_state.set_drafts(host["spec_rows"][0], drafts)
        # (to the host too: a round built there - the next, or after a pipelined run the
        # barrier's - takes its rows' drafts from the commit)
        handle.host["mtp_drafts"] = self._to_host(drafts)

    @staticmethod
    def idle_gaps(handles: list[RoundHandle]) -> list[float]:
        """Device idle time (s) between consecutive rounds: start(N+1) - end(N)."""
        gaps = []
        for a, b in zip(handles, handles[1:]):
            if a.span is None or b.span is None:
                continue
            if isinstance(a.span[1], float):
                gaps.append(max(0.0, b.span[0] - a.span[1]))
            else:
                gaps.append(max(0.0, a.span[1].elapsed_time(b.span[0]) / 1e3))
        return gaps

    @staticmethod
    def _logits_order(batch: ScheduledBatch) -> list[int]:
        """Row index of each logits row (a prompt-scoring row contributes one per token)."""
        order = []
        for i, r in enumerate(batch.rows):
            if r.all_logits:
                order += [i] * r.num_tokens
            elif r.sample:
                order += [i] * r.num_samples
        return order

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out
