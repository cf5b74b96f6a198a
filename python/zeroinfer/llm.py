"""LLM: the offline front end. Tokenize -> engine.add_request -> step until done -> detokenize."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zeroinfer.engine.engine import EngineConfig, LLMEngine
from zeroinfer.engine.request import Request
from zeroinfer.model import load
from zeroinfer.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    logprobs: list | None = None  # per token: (logprob, [(top_id, top_logprob), ...])
    message: object | None = None  # chat(): the parsed reply (reasoning_content, content, ...)
    num_preemptions: int = 0
    # speculative decoding: drafts its verification rows checked, and those kept (a kept
    # draft is a token that took no round of its own)
    num_drafted: int = 0
    num_accepted: int = 0


def _resolve_device(device: str | torch.device) -> torch.device:
    if str(device) != "auto":
        return torch.device(device)
    from zeroinfer import _C

    usable = bool(_C.WITH_CUDA) and _C.cuda_device_count() > 0 and torch.cuda.is_available()
    return torch.device("cuda" if usable else "cpu")


class LLM:
    """Offline inference on one device.

    model: a checkpoint directory or "dummy[:name]" (a tiny random V4 model made on the fly).
    dtype: "auto" (bf16 on CUDA, float32 on CPU), torch.float32 or torch.bfloat16.
    kv_cache_bytes: the KV-cache memory budget (default: room for max_num_seqs sequences of
    max_model_len tokens). async_scheduling: the zero-overhead one-round-ahead pipeline.
    decode_graphs: decode rounds replayed from CUDA graphs (None: on CUDA; False: eager).
    kv_cache_dtype: "auto" (the activation dtype) or "fp8" (the V4 FP8 layout, 584 bytes a
    K=V vector).
    ep: expert parallelism (zeroinfer.parallel.ExpertParallel, e.g. ExpertParallel.for_model(
    zeroinfer.model.model_config(model), ...)): this LLM is one rank of the group - it serves
    its own prompts and holds its slots of the routed experts; every rank calls generate (with
    its own prompts, possibly none) the same number of times.
    speculative: a zeroinfer.SpeculativeConfig to verify drafts in decode rounds (the same
    tokens, more of them a round where the drafts are right): n-gram (prompt lookup) drafts,
    or with method="mtp" the model's own MTP module's (loaded from the checkpoint's `mtp.*`).
    Its rounds are pipelined where decode graphs are on, synchronous otherwise.
    """

    def __init__(self, model: str = "dummy", *, dtype: str | torch.dtype = "auto",
                 device: str | torch.device = "auto", max_num_seqs: int = 64,
                 max_model_len: int = 4096, max_num_batched_tokens: int = 2048,
                 kv_cache_bytes: int | None = None, seed: int = 0, async_scheduling: bool = True,
                 forbid_host_sync: bool = False, decode_graphs: bool | None = None,
                 kv_cache_dtype: str = "auto", tokenizer: object | None = "auto",
                 ep=None, speculative=None) -> None:
        # an expert-parallel rank runs where its ExpertParallel lives, unless told otherwise
        dev = ep.device if ep is not None and str(device) == "auto" else _resolve_device(device)
        if dtype == "auto":
            dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        elif isinstance(dtype, str):
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype, dtype)
        cfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                           max_num_batched_tokens=max_num_batched_tokens,
                           kv_cache_bytes=kv_cache_bytes, async_scheduling=async_scheduling,
                           forbid_host_sync=forbid_host_sync, decode_graphs=decode_graphs,
                           kv_cache_dtype=kv_cache_dtype, speculative=speculative)
        self.model = load(model, dtype=dtype, device=dev, ep=ep, mtp=cfg.mtp)
        if tokenizer == "auto":
            from zeroinfer.tokenizer import Tokenizer

            tokenizer = Tokenizer()
        self.tokenizer = tokenizer
        self.engine = LLMEngine(self.model, cfg, seed=seed, tokenizer=tokenizer)

    # --- helpers ----------------------------------------------------------------------------
    def _encode(self, prompt, i: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if self.tokenizer is None:
                raise ValueError(f"prompt {i} is text but the LLM has no tokenizer")
            return prompt, self.tokenizer.encode(prompt, add_bos=True)
        if isinstance(prompt, Sequence) and all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise ValueError(f"prompt {i} is an empty token list")
            return None, [int(t) for t in prompt]  # (numpy's integers are Integral too)
        raise TypeError(f"prompt {i} must be a string or a list of token ids, got {type(prompt).__name__}")

    def _output(self, prompt: str | None, req: Request) -> RequestOutput:
        text = ""
        if self.tokenizer is not None:
            # A stop token's text is not output, as EOS's is not (the detokenizer of stop
            # strings never sees it either).
            ids = req.output_ids
            if ids and ids[-1] in req.params.stop_token_ids and req.finish_reason == "stop":
                ids = ids[:-1]
            text = req.detok.text if req.detok is not None else self.tokenizer.decode(
                ids, skip_special_tokens=True)
        return RequestOutput(req.request_id, prompt, req.prompt_ids, list(req.output_ids), text,
                             req.finish_reason or "abort",
                             req.output_logprobs if req.params.logprobs is not None else None,
                             num_preemptions=req.num_preemptions,
                             num_drafted=req.num_drafted, num_accepted=req.num_accepted)

    def _run(self, encoded, params_list, use_tqdm: bool) -> list[RequestOutput]:
        for i, ((_, ids), p) in enumerate(zip(encoded, params_list)):  # all before queueing any
            try:
                self.engine.check_request(ids, p)
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from e
        reqs = [self.engine.add_request(ids, p) for (_, ids), p in zip(encoded, params_list)]
        bar = None
        if use_tqdm:
            try:
                from tqdm import tqdm

                bar = tqdm(total=len(reqs), desc="generate", unit="req")
            except ImportError:
                bar = None
        while self.engine.has_work():
            done = self.engine.step()
            if bar is not None and done:
                bar.update(len(done))
        # the last rounds' blocks wait on their events (deferred release): give them back now,
        # so that a finished call leaves every block free
        self.engine.finish()
        if bar is not None:
            bar.close()
        self.engine.release([r.request_id for r in reqs])  # (outputs taken below)
        return [self._output(p, r) for (p, _), r in zip(encoded, reqs)]

    def _params(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams")
        return params

    # --- public -----------------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list (strings or token-id lists); outputs in input order."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts
            and all(isinstance(t, numbers.Integral) for t in prompts))
        plist = [prompts] if single else list(prompts)
        if not plist and self.engine.ep is None:  # an expert-parallel rank may serve others
            raise ValueError("prompts is empty")
        encoded = [self._encode(p, i) for i, p in enumerate(plist)]
        return self._run(encoded, self._params(sampling_params, len(plist)), use_tqdm)

    def chat(self, conversations, sampling_params=None, *, thinking: bool | None = None,
             use_tqdm: bool = True, **request_fields) -> list[RequestOutput]:
        """OpenAI-style conversations (one list of messages, or a list of them) -> replies,
        encoded and parsed with deepseek-recipe and the real V4 tokenizer. thinking: None is the
        recipe's default (on), except for a reply under structured output (off)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer")
        convs = conversations
        if isinstance(convs, Sequence) and convs and isinstance(convs[0], dict):
            convs = [convs]
        params = self._params(sampling_params, len(convs))
        encoded, modes = [], []
        for i, (conv, p) in enumerate(zip(convs, params)):
            # A grammar binds the reply from its first token: with thinking on it would bind the
            # reasoning and leave the answer empty, so a constrained reply is asked without it.
            mode = thinking
            if p.structured is not None:
                if thinking:
                    raise ValueError(f"conversation {i}: structured output constrains the whole "
                                     "reply, reasoning included; use thinking=False (the "
                                     "default for a constrained reply)")
                mode = False
            try:
                ids = self.tokenizer.encode_chat(conv, thinking=mode, **request_fields)
            except (ValueError, TypeError) as e:
                raise type(e)(f"conversation {i}: {e}") from e
            encoded.append((None, ids))
            modes.append(mode)
        outs = self._run(encoded, params, use_tqdm)
        # each reply parsed with the request it was encoded from: tools (tool calls) and an
        # assistant prefix (the prompt closed the thinking already) change the parse
        for conv, p, o, mode in zip(convs, params, outs, modes):
            ids = o.token_ids
            if p.stop and o.text != self.tokenizer.decode(ids, skip_special_tokens=True):
                # cut at a stop string (the ids run up to the token that completed it): the
                # reply is the cut text, whose encoding gives template spellings their ids
                ids = self.tokenizer.encode(o.text)
            o.message = self.tokenizer.parse_chat_output(ids, thinking=mode,
                                                         messages=conv, **request_fields)
        return outs

    def prompt_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits [T, vocab] (float32, CPU) through the engine's own path."""
        ids = list(token_ids)
        req = self.engine.add_request(ids, SamplingParams(max_tokens=1), prompt_logits=True)
        while self.engine.has_work():
            self.engine.step()
        self.engine.finish()
        self.engine.release([req.request_id])
        return torch.cat([t.float() for t in req.prompt_logits]).cpu()
