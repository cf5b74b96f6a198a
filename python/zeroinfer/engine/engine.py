"""LLMEngine: owns the model, caches, scheduler and runner, and drives rounds.

Synchronous mode: schedule N, launch N, wait, commit N.
Zero-overhead mode (default): schedule N+1 and launch it BEFORE committing N, then commit N
while the device runs N+1. The device never waits for Python between rounds; the host catches
up one round behind. Both modes produce identical tokens (the sampler's randomness is keyed by
request seed and position, and the length correction places exactly the committed tokens).

Speculative decoding (EngineConfig.speculative, engine/speculative.py) verifies n-gram drafts
in decode rows. A row's length after a round is known only at its commit, so with decode graphs
its rounds are pipelined from the device: each round's epilogue keeps every slot's length, next
ids (the bonus token, then n-gram drafts from a token history on the device) and draft count
(engine/spec_state.py), and the next round, launched before the host commits this one, reads
its rows from there (Scheduler.schedule_pipelined, ModelRunner._run_pipelined). A round that
needs the host - an admission, a prefill, a constrained request, blocks that need a preemption
- is a barrier: the round in flight is committed first. Without decode graphs (or under expert
parallelism) speculative rounds are synchronous.
"""

from __future__ import annotations

import itertools
import numbers
import random
import time
from dataclasses import dataclass

import torch

from zeroinfer.engine.block_manager import BlockManager
from zeroinfer.engine.request import Request
from zeroinfer.engine.runner import ModelRunner, RoundHandle
from zeroinfer.engine.scheduler import ScheduledBatch, Scheduler
from zeroinfer.engine.speculative import DeviceDrafts, NgramIndex, SpeculativeConfig
from zeroinfer.model import Model
from zeroinfer.model.cache import CacheSpec, allocate_caches
from zeroinfer.model.config import CSA, HCA
from zeroinfer.model.decode_graph import row_bucket
from zeroinfer.quant import kv_fp8
from zeroinfer.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    kv_cache_bytes: int | None = None  # None: room for max_num_seqs full-length sequences
    window_block_size: int = 16
    csa_block_size: int = 16
    hca_block_size: int = 4
    async_scheduling: bool = True
    forbid_host_sync: bool = False  # CUDA: raise on any host sync inside the launch path
    # Decode rounds (one new token a row) in fixed shapes (model/decode_graph.py): replayed
    # CUDA graphs on a GPU. None: on CUDA only (on the CPU the fixed shapes only cost).
    decode_graphs: bool | None = None
    # "auto": the K=V caches in the activation dtype; "fp8": in the V4 FP8 layout (584 bytes a
    # vector: 448 e4m3 NoPE values with 7 power-of-two scales, 64 bf16 RoPE values).
    kv_cache_dtype: str = "auto"
    # Speculative decoding, by n-gram lookup or the model's MTP module (None: off). Its rounds
    # are pipelined where decode graphs are on (LLMEngine.spec_pipelined), synchronous otherwise.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        for f in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "window_block_size",
                  "csa_block_size", "hca_block_size"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be a positive int, got {v!r}")
        if self.decode_graphs is not None and not isinstance(self.decode_graphs, bool):
            raise ValueError(f"decode_graphs must be None (on CUDA only), True or False, got "
                             f"{self.decode_graphs!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        b = self.kv_cache_bytes  # (NaN and infinity once passed, to fail as int() later)
        if b is not None and (isinstance(b, bool) or not isinstance(b, numbers.Real)
                              or not 0 < b < float("inf")):
            raise ValueError(f"kv_cache_bytes must be None or a finite number > 0, got {b!r}")
        for f in ("async_scheduling", "forbid_host_sync"):  # ("false" would turn it on)
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f} must be True or False, got {getattr(self, f)!r}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be None or a SpeculativeConfig, got "
                             f"{type(self.speculative).__name__}")

    @property
    def mtp(self) -> bool:
        """Whether speculative decoding drafts with the model's MTP module."""
        return self.speculative is not None and self.speculative.method == "mtp"

    @property
    def num_draft_tokens(self) -> int:
        return 0 if self.speculative is None else self.speculative.num_draft_tokens

    @property
    def pipelined(self) -> bool:
        """Whether plain rounds run one ahead (zero-overhead): asked for, and not speculative
        (speculative rounds are pipelined by LLMEngine.spec_pipelined)."""
        return self.async_scheduling and self.speculative is None


def kv_bytes_per_token(model: Model, kv_cache_dtype: str = "auto",
                       mtp: bool = False) -> dict[str, float]:
    """Cache bytes one token costs, per kind, over all layers (the layout's theoretical size).
    kv_cache_dtype "fp8": a K=V vector takes the V4 FP8 layout's 584 bytes (the indexer's keys
    stay in the activation dtype). mtp: with the MTP drafter's window cache."""
    c = model.config
    es = torch.finfo(model.net.dtype).bits // 8
    kv = kv_fp8.BYTES_PER_TOKEN if kv_cache_dtype == "fp8" else c.head_dim * es
    n_csa = sum(t == CSA for t in c.layer_types)
    n_hca = sum(t == HCA for t in c.layer_types)
    return {"window": (c.num_hidden_layers + int(mtp)) * kv,
            "csa": n_csa * (kv + c.index_head_dim * es) / c.csa_rate,
            "hca": n_hca * kv / c.hca_rate}


def cache_spec(model: Model, cfg: EngineConfig) -> CacheSpec:
    per_tok = kv_bytes_per_token(model, cfg.kv_cache_dtype, cfg.mtp)
    c = model.config
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    if cfg.kv_cache_bytes is None:  # room for max_num_seqs sequences of max_model_len tokens
        n, L = cfg.max_num_seqs, cfg.max_model_len
        blocks = (n * cdiv(L, cfg.window_block_size), n * cdiv(L // c.csa_rate, cfg.csa_block_size),
                  n * cdiv(L // c.hca_rate, cfg.hca_block_size))
    else:
        tokens = int(cfg.kv_cache_bytes // sum(per_tok.values()))
        blocks = (cdiv(tokens, cfg.window_block_size),
                  cdiv(tokens // c.csa_rate, cfg.csa_block_size),
                  cdiv(tokens // c.hca_rate, cfg.hca_block_size))
    return CacheSpec(
        num_window_blocks=max(1, blocks[0]), num_csa_blocks=max(1, blocks[1]),
        num_hca_blocks=max(1, blocks[2]),
        num_state_slots=cfg.max_num_seqs, window_block_size=cfg.window_block_size,
        csa_block_size=cfg.csa_block_size, hca_block_size=cfg.hca_block_size,
        kv_fp8=cfg.kv_cache_dtype == "fp8", max_discard=cfg.num_draft_tokens)


class LLMEngine:
    def __init__(self, model: Model, cfg: EngineConfig, *, seed: int = 0, tokenizer=None) -> None:
        self.model, self.cfg, self.tokenizer = model, cfg, tokenizer
        if cfg.mtp and not len(model.net.mtp):
            raise ValueError("speculative method 'mtp' needs the model's MTP modules: load it "
                             "with zeroinfer.model.load(..., mtp=True)")
        self.spec = cache_spec(model, cfg)
        caches = allocate_caches(model.config, self.spec, model.net.dtype, model.device,
                                 mtp=int(cfg.mtp))
        self.blocks = BlockManager(model.config, self.spec)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   max_model_len=cfg.max_model_len,
                                   speculative=cfg.speculative)
        self.ep = model.net.ep  # expert parallelism: every round is a collective of its group
        if self.ep is not None and cfg.forbid_host_sync:
            raise ValueError("expert parallelism reads the MoE exchange's row counts on the host "
                             "in eager rounds: it runs with forbid_host_sync=False")
        graphs = model.device.type == "cuda" if cfg.decode_graphs is None else cfg.decode_graphs
        self.runner = ModelRunner(model.net, caches, model.device, forbid_sync=cfg.forbid_host_sync,
                                  decode_graphs=graphs, speculative=cfg.speculative,
                                  max_len=cfg.max_model_len, slots=cfg.max_num_seqs)
        # Speculative rounds pipelined: verification rounds in fixed shapes launched before the
        # round before them is committed, their rows from the device's speculative state.
        self.spec_pipelined = (cfg.speculative is not None and cfg.async_scheduling
                               and graphs and self.ep is None)
        model.net.rope(model.device)  # build the RoPE tables now, not inside a launch
        self.scheduler.round_done = self._round_done
        self.rng = random.Random(seed)
        self.counter = itertools.count()  # the engine's own request ids
        self.requests: dict[str, Request] = {}
        self.inflight: tuple[ScheduledBatch, RoundHandle] | None = None
        self.live: dict[int, RoundHandle] = {}
        self.eos = set(model.config.eos_token_id)
        self.rounds = 0
        self.host_time = {"schedule": 0.0, "launch": 0.0, "commit": 0.0}
        self.history: list[RoundHandle] | None = None  # kept when timing (bench)

    def close(self) -> None:
        self.runner.close()

    # --- requests ---------------------------------------------------------------------------
    def check_request(self, prompt_ids, params: SamplingParams) -> object | None:
        """Raise ValueError/TypeError if the request can never be served; changes nothing.
        Returns the request's grammar matcher (None without structured output)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise ValueError("prompt must be a non-empty list of token ids")
        V = self.model.config.vocab_size
        for i, t in enumerate(prompt_ids):  # (numpy's integers are Integral too)
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TypeError(f"prompt token {i} = {t!r} is a {type(t).__name__}, not an "
                                "integer token id")
            if not 0 <= t < V:
                raise ValueError(f"prompt token {i} = {t!r} is outside the vocabulary [0, {V})")
        if len(prompt_ids) > self.cfg.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens, more than max_model_len="
                             f"{self.cfg.max_model_len}")
        # The cache holds every token but the last output (sampled, never fed back); a
        # speculative decode row holds blocks for its drafts' positions too.
        lookahead = 0 if self.cfg.speculative is None else self.cfg.speculative.lookahead
        longest = min(len(prompt_ids) + params.max_tokens - 1 + lookahead,
                      self.cfg.max_model_len)
        if not self.blocks.can_grow({}, 0) or any(
                k.blocks_for(longest) > k.num_blocks for k in self.blocks.kinds):
            raise ValueError(f"a request of up to {longest} tokens cannot fit in the KV cache; "
                             "raise kv_cache_bytes or lower max_tokens")
        if params.stop and self.tokenizer is None:  # (they are matched in the decoded text)
            raise ValueError("stop strings need a tokenizer (the engine has none); use "
                             "stop_token_ids")
        # (a grammar that does not compile raises here, before add_request draws anything)
        return None if params.structured is None else self._grammars().matcher(params.structured)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, *,
                    request_id: str | None = None, prompt_logits: bool = False) -> Request:
        """Validate and queue a request; raises ValueError/TypeError, leaving the engine as it was."""
        # (whatever can fail comes before the id and the seed are drawn: a refused request
        # changes no other request's id or seed)
        matcher = self.check_request(prompt_ids, params)
        rid = request_id
        while rid is None or (request_id is None and rid in self.requests):
            rid = str(next(self.counter))  # (past the ids a caller chose: "0", "1", ...)
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else self.rng.getrandbits(63)
        req = Request(rid, [int(t) for t in prompt_ids], params, seed,
                      want_prompt_logits=prompt_logits, matcher=matcher)
        if params.stop:
            from zeroinfer.tokenizer import IncrementalDetokenizer

            req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, params.stop)
        if self.cfg.speculative is not None and not prompt_logits:
            # (a prompt-scoring request samples nothing: drafts would only add logits rows)
            spec = self.cfg.speculative
            req.drafter = (DeviceDrafts() if spec.method == "mtp"
                           else NgramIndex(req.prompt_ids, spec.min_ngram, spec.max_ngram))
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def _grammars(self):
        """Structured output's grammar compiler (made on first use: xgrammar is optional)."""
        if self.runner.grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs a tokenizer (the LLM has none)")
            from zeroinfer.structured_output import GrammarBackend

            self.runner.grammars = GrammarBackend.shared(self.tokenizer,
                                                         self.model.config.vocab_size)
        return self.runner.grammars

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r}")
        self.scheduler.abort(req)

    def release(self, request_ids) -> None:
        """Forget finished requests whose outputs the caller has taken (the engine keeps every
        request it was given until then - for abort() and the id checks - so a long-lived
        engine's caller releases them; LLM does after each call). Their ids become free."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                raise KeyError(f"no request {rid!r}")
            if not req.finished:
                raise ValueError(f"request {rid!r} has not finished; abort it first")
        for rid in request_ids:
            del self.requests[rid]

    def has_work(self) -> bool:
        """Whether a step would do anything. Under expert parallelism: on any rank of the
        group (a collective: ranks loop `while has_work(): step()` together)."""
        mine = self.scheduler.has_work() or self.inflight is not None
        return mine if self.ep is None else self.ep.any_rank(mine)

    # --- rounds -----------------------------------------------------------------------------
    def _round_done(self, rid: int, wait: bool) -> bool:
        h = self.live.get(rid)
        if h is None:
            return True
        if wait:
            h.wait()
            return True
        return h.done()

    def _on_token(self, req: Request, tok: int) -> str | None:
        p = req.params
        if req.matcher is not None:  # the token was drawn from its mask: the matcher takes it
            if not req.matcher.accept_token(tok):  # (cannot happen: the mask allowed it)
                return "abort"
            if req.matcher.is_terminated():  # the language is complete (its end-of-sequence)
                return "stop"
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos):
            return "stop"
        if req.detok is not None:
            _, hit = req.detok.push([tok])
            if hit:
                return "stop"
        return None

    def _commit(self, batch: ScheduledBatch, handle: RoundHandle) -> list[Request]:
        result = handle.result()
        done = self.scheduler.commit(batch, result, self._on_token)
        self.live.pop(batch.round_id, None)
        for req in done:  # (ended by max_tokens / EOS: the detokenizer holds back a tail that
            if req.detok is not None:  # could have grown into a stop string; release it)
                req.detok.finish()
        return done

    def step(self) -> list[Request]:
        """Advance by one round; returns requests that finished during this call."""
        t0 = time.perf_counter()
        prev = self.inflight
        finished = []
        batch = None
        if prev is not None and self.spec_pipelined:
            batch = self.scheduler.schedule_pipelined(prev[0], self.runner.graphs.max_rows)
            if batch is None:  # a barrier: commit the round in flight, then schedule on the host
                tb = time.perf_counter()
                finished += self._commit(*prev)
                self.inflight = prev = None
                waited = time.perf_counter() - tb  # (counted as commit time, not scheduling)
                self.host_time["commit"] += waited
                t0 += waited
        if batch is None:
            batch = self.scheduler.schedule(prev[0] if (prev and self.cfg.pipelined) else None)
        t1 = time.perf_counter()
        handle = None
        prev_handle = prev[1] if prev else None
        # Structured output: the masks of a round's draws need the previous round's tokens in
        # the matchers, so with a round in flight its sampling waits for that commit (below).
        defer = prev is not None and any(batch.rows[i].req.matcher is not None
                                         for i in batch.sample_rows)
        if self.ep is not None:
            handle = self._expert_parallel_round(batch, prev_handle, defer)
        elif batch.rows:
            handle = self.runner.launch(batch, prev_handle, defer_sampling=defer)
        if handle is not None:
            self.live[batch.round_id] = handle
            self.rounds += 1
            if self.history is not None:
                self.history.append(handle)
        t2 = time.perf_counter()
        if prev is not None:  # commit round N while round N+1 runs
            finished += self._commit(*prev)
        if handle is not None and defer:
            self.runner.launch_sampling(handle)
        self.inflight = (batch, handle) if handle is not None else None
        if not (self.cfg.pipelined or self.spec_pipelined) and self.inflight is not None:
            finished += self._commit(*self.inflight)
            self.inflight = None
        t3 = time.perf_counter()
        self.host_time["schedule"] += t1 - t0
        self.host_time["launch"] += t2 - t1
        self.host_time["commit"] += t3 - t2
        return finished

    def _expert_parallel_round(self, batch: ScheduledBatch, prev: RoundHandle | None,
                               defer: bool) -> RoundHandle | None:
        """Launch the round in step with the group: a vote first (does any rank run a round,
        can every running rank replay a decode graph, the most rows and the longest row), then
        either every rank replays the graph class of the most rows and the longest row - a rank
        with no sequences one of padding alone, shorter verification rows padded - or every
        rank runs eagerly, a rank with no sequences an idle forward (its MoE layers serve the
        others' tokens). Then the round is counted for the expert-load window and the experts
        are rebalanced when due (all ranks at the same round)."""
        launched = bool(batch.rows)
        # (a rank's rows must have room for the group's longest: a full verification row)
        rows = self.runner.graph_rows(batch, 1 + self.cfg.num_draft_tokens) if launched else 0
        longest = self.runner.graph_tokens(batch) if launched else 1
        any_launched, any_eager, most, longest = self.ep.group_max(
            [int(launched), int(launched and rows is None), rows or 0, longest])
        if not any_launched:
            return None
        graph = row_bucket(most) if self.runner.graphs is not None and not any_eager else None
        handle = None
        if launched:
            handle = self.runner.launch(batch, prev, graph=graph or False, tokens=longest,
                                        defer_sampling=defer)
        else:
            self.runner.run_idle(graph, longest)
        if self.ep.end_step():
            self.runner.run_in_order(self._rebalance_experts)
        return handle

    def _rebalance_experts(self) -> None:
        # Moved experts and new replica tables: the decode graphs read the old ones.
        if self.model.net.rebalance_experts() and self.runner.graphs is not None:
            self.runner.graphs.reset()

    def drain(self) -> None:
        while self.has_work():
            self.step()

    def finish(self) -> None:
        """Run everything queued, wait for the device, and release every deferred block."""
        self.drain()
        for h in list(self.live.values()):
            h.wait()
        self.live.clear()
        self.scheduler.reclaim(wait=False)
