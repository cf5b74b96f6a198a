"""Batched, seeded, host-sync-free token sampling.

`sample(logits, batch)` picks one token per row of `logits` [R, V]:

* rows with temperature 0: argmax of the raw logits (ties go to the lowest token id);
* other rows: z = (logits - max) / temperature, then top-k, then top-p (on the renormalised
  top-k distribution), then min-p, and a Gumbel-max draw over the tokens that remain:
  token = argmax_i (z_i + G_i) with G_i = -log(-log(u_i)), which picks token i with
  probability softmax(z restricted to the kept set)_i.

Filter semantics (ranks come from a STABLE descending sort of z, so equal values are ranked by
lower token id first):

* top-k keeps ranks [0, k);
* top-p keeps rank j iff the mass of ranks [0, j) (renormalised over the top-k set) is < top_p,
  i.e. the smallest prefix whose mass reaches top_p; rank 0 is always kept; top_p = 1 keeps all;
* min-p keeps token i iff p_i >= min_p * p_max, i.e. z_i >= log(min_p) (z_max = 0).

Random stream. The uniforms u come from a counter-based hash, computed with int64 torch ops
only (xor, logical shifts emulated by arithmetic shift + mask, wrapping multiply, wrapping add),
which give identical bits on every device:

    key_r   = mix64(mix64(seed_r + GAMMA) ^ position_r)
    bits_ri = mix64(key_r + (i + 1) * GAMMA)          # the splitmix64 stream seeded with key_r
    u_ri    = (2 * (bits_ri >>> 12) + 1) * 2**-53    # in (0, 1), on the 2**-53 grid

with mix64 the splitmix64 finaliser and GAMMA = 0x9E3779B97F4A7C15 (all arithmetic modulo 2**64).
So the token of a row depends only on its logits row, its parameters, its seed and position:
not on the batch size, the row order or the other rows. Across devices the random bits are
identical; the floating-point filters and Gumbel noise (computed in float64) may differ in the
last bits, which can change a token only in near-tie cases.

No host synchronisation: `sample` uses no .item()/.tolist()/.cpu(), no nonzero or boolean-mask
indexing, and branches only on host values (shapes and the host fields of `SamplingBatch`), so it
can be queued in an asynchronous launch path (and works on the "meta" device).

Inputs: logits should be finite or -inf (e.g. masked vocabulary padding), with at least one
finite value per row; -inf tokens are never sampled. NaN logits give unspecified tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zeroinfer.sampling_params import SEED_LIMIT, SamplingParams
from zeroinfer.structured_output import allowed_tokens


def _s64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return x - (1 << 64) if x >= (1 << 63) else x


GAMMA = _s64(0x9E3779B97F4A7C15)
_MIX1 = _s64(0xBF58476D1CE4E5B9)
_MIX2 = _s64(0x94D049BB133111EB)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> on int64 is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser on int64 tensors (multiplies wrap modulo 2**64)."""
    x = x ^ _srl(x, 30)
    x = x * _MIX1
    x = x ^ _srl(x, 27)
    x = x * _MIX2
    return x ^ _srl(x, 31)


def random_bits(seed: torch.Tensor, position: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seed [R] int64, position [R] int64 -> [R, vocab_size] int64: 64 random bits per
    (row, vocabulary index), a pure function of (seed, position, index)."""
    key = _mix64(_mix64(seed + GAMMA) ^ position)  # [R]
    ctr = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seed.device) * GAMMA
    return _mix64(key[:, None] + ctr[None, :])


def uniforms(seed: torch.Tensor, position: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, vocab_size] float64 uniforms in (0, 1): (2 * (bits >>> 12) + 1) * 2**-53."""
    m = _srl(random_bits(seed, position, vocab_size), 12)  # [0, 2**52)
    return (m * 2 + 1).to(torch.float64) * (2.0**-53)


@dataclass
class SamplingBatch:
    """Device tensors describing the R rows of one `sample` call (row r <-> logits row r).

    temperature [R] float32 (0 = greedy), top_k [R] int32 (0 = off), top_p [R] float32
    (1 = off), min_p [R] float32 (0 = off), seed [R] int64, position [R] int64 (the absolute
    position of the token being sampled; with the seed it keys the random stream).

    Host fields: max_logprobs (the largest requested logprobs k, -1 when no row asks);
    needs_sort / any_sampled are conservative host hints that let `sample` skip work: they must
    be True when some row uses top-k/top-p (needs_sort) or has temperature > 0 (any_sampled).
    Leaving them True is always correct; `build` sets them exactly. Skipping never changes a
    row's token.

    allowed: None, or int32 [R, words] on the device, the structured-output token bitmask
    (zeroinfer.structured_output.allowed_tokens): a row draws only among its allowed tokens.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor
    position: torch.Tensor
    max_logprobs: int = -1
    needs_sort: bool = True
    any_sampled: bool = True
    allowed: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        positions: Sequence[int],
        device: torch.device | str,
        allowed: torch.Tensor | None = None,
    ) -> SamplingBatch:
        """One row per request: `seeds` are resolved by the engine (a request without a seed
        gets one from the engine's RNG), each in [0, 2**63); `positions` are the absolute
        positions (>= 0) of the tokens being sampled."""
        n = len(params)
        if len(seeds) != n or len(positions) != n:
            raise ValueError(
                f"SamplingBatch.build: params, seeds and positions must have equal lengths, "
                f"got {n}, {len(seeds)}, {len(positions)}"
            )
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(
                    f"SamplingBatch.build: params must be SamplingParams, got {type(p).__name__}"
                )
        for s in seeds:
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < SEED_LIMIT:
                raise ValueError(
                    f"SamplingBatch.build: seeds must be ints in [0, 2**63), got {s!r}"
                )
        # (a tensor of positions on the device - a pipelined round's, known only there - is
        # taken as it is)
        for q in ([] if isinstance(positions, torch.Tensor) else positions):
            if isinstance(q, bool) or not isinstance(q, int) or not 0 <= q < SEED_LIMIT:
                raise ValueError(f"SamplingBatch.build: positions must be ints >= 0, got {q!r}")
        sampled = [p for p in params if p.temperature > 0]
        requested = [p.logprobs for p in params if p.logprobs is not None]
        device = torch.device(device)

        def put(values, dtype):
            # Pinned host memory + non_blocking: the copy never makes the host wait, so build()
            # can sit in the engine's launch path.
            t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values,
                                                                                    dtype=dtype)
            if device.type == "cuda":
                return t.pin_memory().to(device, non_blocking=True)
            return t.to(device)

        return cls(
            temperature=put([p.temperature for p in params], torch.float32),
            top_k=put([p.top_k for p in params], torch.int32),
            top_p=put([p.top_p for p in params], torch.float32),
            min_p=put([p.min_p for p in params], torch.float32),
            seed=put(list(seeds), torch.int64),
            position=(positions.to(torch.int64) if isinstance(positions, torch.Tensor)
                      else put(list(positions), torch.int64)),
            max_logprobs=max(requested, default=-1),
            needs_sort=any(p.top_k > 0 or p.top_p < 1.0 for p in sampled),
            any_sampled=bool(sampled),
            allowed=None if allowed is None else put(allowed, torch.int32),
        )


@dataclass
class SampleResult:
    """tokens [R] int64; logprob [R] float32 = log_softmax(raw logits) at the token;
    top_ids / top_logprobs [R, k] (int64 / float32, k = batch.max_logprobs, most likely first,
    of the raw distribution; equal values in unspecified order), or None when max_logprobs < 0."""

    tokens: torch.Tensor
    logprob: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def _check(logits: torch.Tensor, batch: SamplingBatch) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"sample: logits must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"sample: logits must be floating point, got {logits.dtype}")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"sample: logits must have shape [R, V] with V >= 1, got "
                         f"{tuple(logits.shape)}")
    R = logits.shape[0]
    for name in ("temperature", "top_k", "top_p", "min_p", "seed", "position"):
        t = getattr(batch, name)
        if t.shape != (R,):
            raise ValueError(f"sample: batch.{name} must have shape [{R}], got {tuple(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"sample: batch.{name} is on {t.device}, logits on {logits.device}")
    a = batch.allowed
    if a is not None:
        if a.dtype != torch.int32 or a.dim() != 2 or a.shape[0] != R or a.shape[1] < 1:
            raise ValueError(f"sample: batch.allowed must be an int32 bitmask [{R}, words], got "
                             f"{a.dtype} {tuple(a.shape)}")
        if a.device != logits.device:
            raise ValueError(f"sample: batch.allowed is on {a.device}, logits on {logits.device}")


def _sampled_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The filtered Gumbel-max draw of every row (rows with temperature 0 give garbage)."""
    R, V = logits.shape
    # (a temperature past float32's range is inf here, and -inf / inf = NaN would put masked
    # tokens first in the sort: the largest finite one keeps -inf at -inf, the rest at ~0)
    temp = torch.where(batch.temperature > 0, batch.temperature, 1.0).clamp(
        max=torch.finfo(torch.float32).max)
    # z <= 0 with z = 0 at the row maximum; + 0.0 turns -0.0 into +0.0 so ties sort as equal.
    z = (logits - logits.amax(dim=-1, keepdim=True)) / temp[:, None] + 0.0

    # min-p: p_i >= min_p * p_max  <=>  z_i >= log(min_p)  (min_p = 0 -> -inf keeps all)
    keep = z.double() >= torch.log(batch.min_p.double())[:, None]

    if batch.needs_sort:
        zs, order = torch.sort(z, dim=-1, descending=True, stable=True)
        rank = torch.arange(V, device=z.device)
        k = batch.top_k.long()
        keep_s = rank[None, :] < torch.where(k > 0, k, V)[:, None]  # top-k
        e = torch.exp(zs.double()) * keep_s  # unnormalised mass of the top-k set, e[:, 0] = 1
        c = torch.cumsum(e, dim=-1)
        before = torch.nn.functional.pad(c[:, :-1], (1, 0))  # mass of ranks [0, j)
        p_off = (batch.top_p >= 1.0)[:, None]
        keep_s &= (before < batch.top_p.double()[:, None] * c[:, -1:]) | p_off  # top-p
        # keep_s is a prefix of the ranks; map it back to vocabulary order through its last
        # element (value zt, id it): stable order puts ties with zt before it iff id <= it.
        last = (keep_s.sum(dim=-1, keepdim=True) - 1).clamp_min(0)  # >= 0: rank 0 is kept
        zt = zs.gather(1, last)
        it = order.gather(1, last)
        ids = rank[None, :]
        keep &= (z > zt) | ((z == zt) & (ids <= it))

    u = uniforms(batch.seed, batch.position, V)
    gumbel = -torch.log(-torch.log(u))
    score = torch.where(keep, z.double() + gumbel, float("-inf"))
    return torch.argmax(score, dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
    """Sample one token per row of logits [R, V] (float32; other float dtypes are upcast)
    under `batch` (see the module docstring for the exact semantics). Never synchronises with
    the host."""
    _check(logits, batch)
    logits = raw = logits.float()
    V = logits.shape[1]
    if batch.allowed is not None:  # structured output: the draw among the allowed tokens
        logits = raw.masked_fill(~allowed_tokens(batch.allowed, V), float("-inf"))
    greedy = torch.argmax(logits, dim=-1)  # first maximum = lowest id
    if batch.any_sampled:
        tokens = torch.where(batch.temperature > 0, _sampled_tokens(logits, batch), greedy)
    else:
        tokens = greedy
    logits = raw  # (the logprobs: of the raw distribution)
    lse = torch.logsumexp(logits, dim=-1)
    logprob = logits.gather(1, tokens[:, None]).squeeze(1) - lse
    out = SampleResult(tokens=tokens, logprob=logprob)
    if batch.max_logprobs >= 0:
        k = min(batch.max_logprobs, V)
        vals, ids = torch.topk(logits, k, dim=-1, largest=True, sorted=True)
        out.top_ids = ids
        out.top_logprobs = vals - lse[:, None]
    return out


__all__ = ["SampleResult", "SamplingBatch", "random_bits", "sample", "uniforms"]
