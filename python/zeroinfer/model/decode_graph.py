"""Decode steps in fixed shapes, replayed from CUDA graphs.

A GPU decode step of a small batch is bound by the host: some 660 torch calls and 360 launches
a round for four layers (bench/probe_decode_ops.py). A CUDA graph replays them in one call, but
only if every shape, and the number of every write, is the same from step to step.
ForwardBatch.decode gives the forward that form (the compressors pool every token's window and
keep those that close, the indexer and HCA take what the tables hold): its shapes follow the row
count, the tokens a row and the block tables' widths alone. So one graph serves every step of a
class (rows, tokens a row, widths): the rows padded up to ROW_BUCKETS, each table's width to a
power of two. A row is one new token, or a speculative verification row of several (the
sampled token and its drafts; the caches' CacheSpec.max_discard must cover the drafts).

Padding rows are fresh sequences whose every write lands in the caches' scratch (the window
pool's scratch block, the scratch state slot; model/cache.py). A graph is captured on padding
rows alone, so capturing it writes nothing that a sequence reads.

On the CPU the same fixed-shape forward runs eagerly: CI tests the form the GPU captures.
Graphs hold the weights' and caches' addresses: make the DecodeGraphs after loading, and a new
one if the weights or caches are replaced (or `reset()` it).

Under expert parallelism a step's MoE layers exchange a fixed number of rows with every rank
(ExpertParallel.fixed_capacity, its padding rows marked): all ranks must run steps of the same
row class together, a rank with no sequences a step of padding alone (`run(..., rows=)`); the
caller agrees on the class with the group first. A graph's warm-up runs exchange nothing (one
rank captures alone); replays exchange for real.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from zeroinfer.model.cache import DecodeRows, ForwardBatch, LayerCache, host_tensor

# Row counts a graph is made for: a step of S rows runs in the first bucket >= S.
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
KINDS = ("window", "csa", "hca")

# What capture_graph has captured so far in this process, by class (decode classes, speculative
# epilogues, MTP drafter steps): a capture synchronises the device and takes milliseconds, so a
# benchmark reads this to tell a steady state (no captures) from one that still meets new
# classes, and which classes those are.
_captured: list[str] = []


def graph_captures() -> int:
    """The number of CUDA graphs capture_graph has captured in this process."""
    return len(_captured)


def captured_classes(since: int = 0) -> list[str]:
    """The classes of the captures after the first `since` (graph_captures() taken earlier)."""
    return _captured[since:]


def capture_graph(fn, device: torch.device, pool, *, what: str, warmups: int = 1,
                  warm_ctx=nullcontext, capture_ctx=nullcontext):
    """Run fn() `warmups` times on a side stream (as torch asks before a capture), then capture
    it into a CUDA graph sharing the memory `pool`; returns (graph, what the captured fn()
    returned). what: the class captured, for captured_classes. warm_ctx / capture_ctx: context
    factories entered around the warm-ups and the capture. Capturing synchronises the device
    (torch does, on entry), once a graph: the engine's sync guard (torch's sync debug mode) is
    lifted for it."""
    guard = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), warm_ctx():
            for _ in range(warmups):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool), capture_ctx():
            out = fn()
    finally:
        torch.cuda.set_sync_debug_mode(guard)
    _captured.append(what)
    return graph, out


def row_bucket(rows: int) -> int:
    for b in ROW_BUCKETS:
        if b >= rows:
            return b
    raise ValueError(f"decode graphs: {rows} rows exceed the largest bucket ({ROW_BUCKETS[-1]})")


def width_bucket(blocks: int) -> int:
    """A table width (in blocks) rounded up to a power of two (at least 1)."""
    return 1 << max(0, blocks - 1).bit_length()


class FixedStep:
    """One class's fixed inputs (on the device) and, on CUDA, its graph and output."""

    # Normal tensors even when made under inference mode (an expert-parallel rank's first
    # step of a class may be a padding step, run by ModelRunner.run_in_order): the rounds
    # refill them outside it.
    @torch.inference_mode(False)
    def __init__(self, rows: int, tokens: int, widths: dict[str, int],
                 device: torch.device) -> None:
        i64 = dict(dtype=torch.int64, device=device)
        self.rows, self.tokens, self.widths = rows, tokens, widths
        self.ids = torch.zeros(rows * tokens, **i64)
        # context lengths (the rows' first positions), state slots, 1 for a sequence's row / 0
        # for padding
        self.meta = torch.zeros(3, rows, **i64)
        self.tables = {k: torch.full((rows, w), -1, dtype=torch.int32, device=device)
                       for k, w in widths.items()}
        self.seq = torch.arange(rows, **i64).repeat_interleave(tokens)  # each token's row
        self.offset = torch.arange(tokens, **i64).repeat(rows)  # its place in the row
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        # the last layer's streams of every token (a model with MTP modules: their input)
        self.streams: torch.Tensor | None = None

    @property
    def key(self) -> str:
        """The class, as captured_classes names it."""
        return f"rows={self.rows} tokens={self.tokens} widths={self.widths}"

    def real(self) -> torch.Tensor:
        """[rows * tokens] bool: the tokens of sequences' rows (not padding)."""
        return self.meta[2][self.seq] != 0

    def batch(self) -> ForwardBatch:
        """A ForwardBatch over the fixed inputs (a new one each step: its derived values are
        the step's). A row's tokens sit at its context length onwards; a padding row's all at
        position 0 (so it sees no compressed entry, closes no window and writes only
        scratch)."""
        n, q = self.rows, self.tokens
        real = self.meta[2][self.seq]
        positions = self.meta[0][self.seq] + self.offset * real
        return ForwardBatch(
            input_ids=self.ids, positions=positions, cu_seqlens=list(range(0, n * q + 1, q)),
            context_lens=[0] * n, window_tables=self.tables["window"],
            csa_tables=self.tables["csa"], hca_tables=self.tables["hca"], state_slots=[0] * n,
            seq=self.seq, decode=DecodeRows(self.meta[1][self.seq], real != 0))


def _table(t) -> torch.Tensor:
    """A kind's tables as an int32 CPU tensor [S, width >= 1], -1 past each row's blocks (a
    tensor as given, or padded from lists of block ids)."""
    if isinstance(t, torch.Tensor):
        return t
    if not t:
        return torch.empty(0, 0, dtype=torch.int32)
    width = max([len(r) for r in t] + [1])
    return torch.tensor([list(r) + [-1] * (width - len(r)) for r in t], dtype=torch.int32)


class DecodeGraphs:
    """Runs decode steps (the same number of new tokens a sequence: one, or a verification
    row's) of `net` over `caches` in fixed shapes: from CUDA graphs on a GPU (captured on first
    use of a class, sharing one memory pool), eagerly on the CPU. `run` returns the logits
    [S * tokens, V] float32; on CUDA they are the graph's output, overwritten by the next step
    of that class."""

    def __init__(self, net, caches: list[LayerCache], device: torch.device | str) -> None:
        self.net, self.caches, self.device = net, caches, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.steps: dict[tuple, FixedStep] = {}
        self.max_rows = ROW_BUCKETS[-1]  # larger steps run eagerly (takes)
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.scratch_window = caches[0].window.shape[0] - 1
        self.keep_streams = len(getattr(net, "mtp", ())) > 0
        self.last: FixedStep | None = None  # the step of the last run (its batch and streams)
        states = [s for c in caches for s in c.state.values()]
        self.scratch_slot = states[0].scratch_slot if states else 0  # (none: slots unused)

    def takes(self, rows: int) -> bool:
        """Whether a decode step of `rows` sequences has a class (the callers run larger ones
        through the variable-shape forward)."""
        return 1 <= rows <= self.max_rows

    def run(self, input_ids, context_lens: list[int], state_slots: list[int],
            tables: dict[str, torch.Tensor | list[list[int]]], *,
            rows: int | None = None, tokens: int = 1) -> torch.Tensor:
        """One step of S = len(context_lens) sequences of `tokens` new tokens each: input_ids
        [S * tokens] row major (a list, or a device tensor such as the previous round's
        samples), each sequence's context length (the tokens cached before its first new one:
        that one's position; a list, or a device tensor), state slot and block tables (per kind, "window" / "csa" /
        "hca": lists of block ids, or an int32 CPU tensor [S, w] with -1 past each row's
        blocks; they must hold every new token's position). rows: run in the class of that
        many rows (>= S; S may be 0), not of S's: what an expert-parallel group agreed on."""
        S = len(context_lens)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"decode graphs: tokens must be an int >= 1, got {tokens!r}")
        if len(state_slots) != S or (rows is None and not S):
            raise ValueError(f"decode graphs: context_lens and state_slots must have one entry "
                             f"a sequence (>= 1), got {S} and {len(state_slots)}")
        if rows is not None and not max(S, 1) <= rows <= self.max_rows:
            raise ValueError(f"decode graphs: rows must be in [max(1, {S} sequences), "
                             f"{self.max_rows}], got {rows}")
        tables = {k: _table(tables[k]) for k in KINDS}
        widths = {k: width_bucket(tables[k].shape[1]) for k in KINDS}
        key = (row_bucket(S if rows is None else rows), tokens, tuple(widths[k] for k in KINDS))
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = FixedStep(key[0], tokens, widths, self.device)
            if self.cuda:
                self._capture(step)
        self._fill(step, input_ids, context_lens, state_slots, tables)
        self.last = step
        if not self.cuda:
            with self._exchange(step):
                return self._forward(step)[:S * tokens]
        step.graph.replay()
        return step.logits[:S * tokens]

    def _forward(self, step: FixedStep) -> torch.Tensor:
        out: list[torch.Tensor] = []
        logits = self.net(step.batch(), self.caches,
                          streams_out=out if self.keep_streams else None)
        step.streams = out[0] if out else None
        return logits

    def reset(self) -> None:
        """Drop every captured step (recaptured on next use): after the weights a graph reads
        changed where they lie - an expert-parallel rebalance rewrote the expert slots (the
        kernels' prepacked copies are rebuilt elsewhere) and the replica tables."""
        self.steps.clear()

    @contextmanager
    def _exchange(self, step: FixedStep, loopback: bool = False):
        """Expert parallelism: the step's MoE layers exchange a fixed step.rows * step.tokens
        token rows with each rank, the padding rows' (meta[2] == 0) routed nowhere."""
        ep = getattr(self.net, "ep", None)
        if ep is None:
            yield
            return
        with ep.fixed_capacity(step.rows * step.tokens, step.real(), loopback=loopback):
            yield

    def _fill(self, step: FixedStep, input_ids, context_lens, state_slots, tables) -> None:
        """The step's inputs into the class's fixed tensors; rows past S are padding."""
        n, S, q = step.rows, len(context_lens), step.tokens
        pad = n - S
        on_device = isinstance(context_lens, torch.Tensor)  # (a pipelined round's lengths)
        meta = [[0] * n if on_device else list(context_lens) + [0] * pad,
                list(state_slots) + [self.scratch_slot] * pad, [1] * S + [0] * pad]
        step.meta.copy_(host_tensor(meta, self.device), non_blocking=True)
        if on_device:
            step.meta[0, :S].copy_(context_lens.view(-1), non_blocking=True)
        got = input_ids.numel() if isinstance(input_ids, torch.Tensor) else len(input_ids)
        if got != S * q:
            raise ValueError(f"decode graphs: {S} rows of {q} tokens take {S * q} input ids, "
                             f"got {got}")
        if isinstance(input_ids, torch.Tensor):
            step.ids[:S * q].copy_(input_ids.view(-1), non_blocking=True)
            if pad:
                step.ids[S * q:].zero_()
        else:
            step.ids.copy_(host_tensor(list(input_ids) + [0] * (pad * q), self.device),
                           non_blocking=True)
        for k in KINDS:
            t = _table(tables[k])
            rows = torch.full((n, step.widths[k]), -1, dtype=torch.int32)
            rows[:S, :t.shape[1]] = t
            if k == "window":  # padding rows write their tokens (position 0) to scratch
                rows[S:, 0] = self.scratch_window
            step.tables[k].copy_(host_tensor(rows, self.device, torch.int32), non_blocking=True)

    def _capture(self, step: FixedStep) -> None:
        """Capture the class's graph on padding rows alone (every write to scratch), after two
        warm-ups (capture_graph); the warm-ups exchange nothing (loopback)."""
        self._fill(step, [], [], [], {k: [] for k in KINDS})
        step.graph, step.logits = capture_graph(
            lambda: self._forward(step), self.device, self.pool,
            what=f"decode {step.key}", warmups=2,
            warm_ctx=lambda: self._exchange(step, loopback=True),
            capture_ctx=lambda: self._exchange(step))
