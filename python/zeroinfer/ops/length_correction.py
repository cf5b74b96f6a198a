"""Device-side length correction for the zero-overhead (one-round-ahead) scheduler.

The CPU lays out round N+1 before round N's sampled tokens exist. For every row it assumes how
many tokens round N commits (`assumed_accepted`) and reserves `q_opt = cu_seqlens_q[i+1] -
cu_seqlens_q[i]` token slots. This op reads round N's real results where they already are (on
the device) and fixes the round-N+1 metadata without any host round trip:

    p      = remap[i]                      # row i's row in round N; -1 = fresh / CPU-exact
    delta  = prev_num_accepted[p] - assumed_accepted[i]
    q      = min(q_opt, prev_num_next[p])  # next-input tokens round N produced for the row
    seqlens_q[i] = q
    seqlens_k[i] = seqlens_k_in[i] + delta - (q_opt - q)
    slot j <  q : positions += delta ; input_ids = prev_next_tokens[p, j]
    slot j >= q : positions  = -1    ; input_ids = 0     (unused slot: the model skips it)

Rows with remap = -1 are copied unchanged. Without speculative decoding every row has q_opt = 1,
assumed = accepted = 1, and the op just places the token sampled in round N. With drafts,
prev_next_tokens[p] = [bonus token, draft_1, ...] and prev_num_accepted = 1 + accepted drafts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from zeroinfer import _C
from zeroinfer.ops._backend import ptr, stream_of, use_cuda
from zeroinfer.ops._checks import check_tensor


class CorrectedLengths(NamedTuple):
    seqlens_q: torch.Tensor  # [R] int32
    seqlens_k: torch.Tensor  # [R] int32
    positions: torch.Tensor  # [num_tokens] int32, -1 for unused slots
    input_ids: torch.Tensor  # [num_tokens] int32


def correct_lengths(
    remap: torch.Tensor,
    prev_num_accepted: torch.Tensor,
    prev_next_tokens: torch.Tensor,
    prev_num_next: torch.Tensor,
    assumed_accepted: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    positions: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    out: CorrectedLengths | None = None,
    check: bool | None = None,
) -> CorrectedLengths:
    """Correct round N+1's lengths, positions and input ids from round N's results.

    All tensors int32 and on one device. Round N+1 (R rows, num_tokens slots): remap [R],
    assumed_accepted [R], cu_seqlens_q [R+1], seqlens_k [R], positions [num_tokens],
    input_ids [num_tokens]. Round N (R_prev rows): prev_num_accepted [R_prev],
    prev_next_tokens [R_prev, S], prev_num_next [R_prev]. Returns new tensors (or fills `out`).
    Values (remap range, cu_seqlens_q monotone and ending at num_tokens, prev_num_next <= S)
    are checked for CPU tensors, and for CUDA tensors only with check=True (a host sync).
    """
    op = "correct_lengths"
    i32 = (torch.int32,)
    check_tensor(op, "remap", remap, dtypes=i32, ndim=1)
    dev = remap.device
    (num_rows,) = remap.shape
    check_tensor(op, "prev_next_tokens", prev_next_tokens, dtypes=i32, ndim=2, device=dev)
    num_prev, width = prev_next_tokens.shape
    check_tensor(op, "prev_num_accepted", prev_num_accepted, dtypes=i32, shape=(num_prev,),
                 device=dev)
    check_tensor(op, "prev_num_next", prev_num_next, dtypes=i32, shape=(num_prev,), device=dev)
    check_tensor(op, "assumed_accepted", assumed_accepted, dtypes=i32, shape=(num_rows,),
                 device=dev)
    check_tensor(op, "cu_seqlens_q", cu_seqlens_q, dtypes=i32, shape=(num_rows + 1,), device=dev)
    check_tensor(op, "seqlens_k", seqlens_k, dtypes=i32, shape=(num_rows,), device=dev)
    check_tensor(op, "positions", positions, dtypes=i32, ndim=1, device=dev)
    (num_tokens,) = positions.shape
    check_tensor(op, "input_ids", input_ids, dtypes=i32, shape=(num_tokens,), device=dev)
    cuda = use_cuda(dev, op)
    if not cuda or check:
        _check_values(remap, num_prev, width, prev_num_next, cu_seqlens_q, num_tokens)
    if out is None:
        out = CorrectedLengths(torch.empty_like(remap), torch.empty_like(seqlens_k),
                               torch.empty_like(positions), torch.empty_like(input_ids))
    else:
        for name, t, ref in zip(CorrectedLengths._fields, out,
                                (remap, seqlens_k, positions, input_ids)):
            check_tensor(op, f"out.{name}", t, dtypes=i32, shape=tuple(ref.shape), device=dev)
    _C.correct_lengths(cuda, num_rows, num_prev, width, num_tokens, ptr(remap),
                       ptr(assumed_accepted), ptr(prev_num_accepted), ptr(prev_next_tokens),
                       ptr(prev_num_next), ptr(cu_seqlens_q), ptr(seqlens_k), ptr(positions),
                       ptr(input_ids), ptr(out.seqlens_q), ptr(out.seqlens_k), ptr(out.positions),
                       ptr(out.input_ids), stream_of(dev))
    return out


def _check_values(remap, num_prev, width, prev_num_next, cu_seqlens_q, num_tokens) -> None:
    op = "correct_lengths"
    if remap.numel() and (int(remap.min()) < -1 or int(remap.max()) >= num_prev):
        raise ValueError(f"{op}: remap values must be -1 or a row of round N in [0, {num_prev}), "
                         f"got range [{int(remap.min())}, {int(remap.max())}]")
    if prev_num_next.numel() and (int(prev_num_next.min()) < 0 or int(prev_num_next.max()) > width):
        raise ValueError(f"{op}: prev_num_next values must be in [0, {width}] (columns of "
                         "prev_next_tokens)")
    cu = cu_seqlens_q
    if int(cu[0]) != 0 or int(cu[-1]) != num_tokens or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{op}: cu_seqlens_q must start at 0, be nondecreasing and end at "
                         f"num_tokens={num_tokens} (the length of positions)")
