"""V4's MoE router after its linear layer, in one launch (the torch form was ~12 calls a layer):

    s[e] = sqrt(softplus(logits[t, e]))            each op rounded to the logits' dtype, as HF's
    learned routing: ids = the k largest s[e] + bias[e] (float32), descending, ties to the lower
                     expert index (NaN ranks first, as in torch.topk)
    hash routing:    ids = hash_table[input_ids[t]]
    weights[j] = s[ids[j]] / (sum_j s[ids[j]] + 1e-20) * scale

The bias only chooses; the weights come from the unbiased scores, renormalised over the chosen
experts (V4 always renormalises). A token's result depends on its own row alone
(batch-invariant); the CPU twin and the CUDA kernel run the same operations in the same order,
so they agree but for exp / log1p's last bit.
"""

from __future__ import annotations

import torch

from zeroinfer import _C
from zeroinfer.ops._backend import dtype_code, ptr, stream_of, use_cuda
from zeroinfer.ops._checks import (check_float, check_no_alias, check_positive_int,
                                   check_tensor, row_stride)

MOE_ROUTE_MAX_EXPERTS = 512
MOE_ROUTE_MAX_TOPK = 16


def moe_route(logits: torch.Tensor, k: int, *, scale: float, bias: torch.Tensor | None = None,
              hash_table: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
              out: tuple[torch.Tensor, torch.Tensor] | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k] int32, weights [T, k] float32) of every token (definition in the module doc).

    logits [T, E] float32 or bfloat16, E <= 512, rows unit-stride and evenly spaced (contiguous,
    or a column slice of a wider matrix, as FusedLinears' outputs are). Learned routing: bias
    float32 [E], k <= E.
    Hash routing: hash_table int64 [V, k] of expert ids and input_ids int64 [T] (token ids in
    [0, V)), no bias. k <= 16. All contiguous, on one device. On the CPU the token ids and the
    table rows they pick are checked; on CUDA (no host synchronisation) a token id or a table
    entry out of range gives ids -1 and NaN weights for that token. `out`: (ids, weights) to
    fill instead of new tensors.
    """
    op = "moe_route"
    stride = row_stride(logits)
    check_tensor(op, "logits", logits, dtypes=(torch.float32, torch.bfloat16), ndim=2,
                 contiguous=stride is None)
    dev = logits.device
    T, E = logits.shape
    if not 1 <= E <= MOE_ROUTE_MAX_EXPERTS:
        raise ValueError(f"{op}: logits must have 1..{MOE_ROUTE_MAX_EXPERTS} experts (columns), "
                         f"got {E}")
    check_positive_int(op, "k", k)
    if k > MOE_ROUTE_MAX_TOPK:
        raise ValueError(f"{op}: k must be <= {MOE_ROUTE_MAX_TOPK}, got {k}")
    scale = check_float(op, "scale", scale)
    if (bias is None) == (hash_table is None):
        raise ValueError(f"{op}: give exactly one of bias (learned routing) and hash_table "
                         f"(hash routing)")
    vocab = 0
    if bias is not None:
        check_tensor(op, "bias", bias, dtypes=(torch.float32,), shape=(E,), device=dev)
        if input_ids is not None:
            raise ValueError(f"{op}: input_ids is for hash routing (with hash_table), not bias")
        if k > E:
            raise ValueError(f"{op}: k must be <= the number of experts ({E}), got {k}")
    else:
        check_tensor(op, "hash_table", hash_table, dtypes=(torch.int64,), shape=(None, k),
                     device=dev)
        if input_ids is None:
            raise ValueError(f"{op}: hash routing needs input_ids")
        check_tensor(op, "input_ids", input_ids, dtypes=(torch.int64,), shape=(T,), device=dev)
        vocab = hash_table.shape[0]
        if T and not logits.is_cuda:
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= vocab:
                raise ValueError(f"{op}: input_ids must be in [0, {vocab}) (hash_table's rows), "
                                 f"got values in [{lo}, {hi}]")
            rows = hash_table[input_ids]
            if int(rows.min()) < 0 or int(rows.max()) >= E:
                raise ValueError(f"{op}: hash_table's rows for these tokens must hold expert ids "
                                 f"in [0, {E}), got values in [{int(rows.min())}, "
                                 f"{int(rows.max())}]")
    if out is None:
        out = (torch.empty(T, k, dtype=torch.int32, device=dev),
               torch.empty(T, k, dtype=torch.float32, device=dev))
    else:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"{op}: out must be a tuple (ids, weights)")
        check_tensor(op, "out[0] (ids)", out[0], dtypes=(torch.int32,), shape=(T, k), device=dev)
        check_tensor(op, "out[1] (weights)", out[1], dtypes=(torch.float32,), shape=(T, k),
                     device=dev)
        check_no_alias(op, {"ids": out[0], "weights": out[1]},
                       {"logits": logits, "bias": bias, "hash_table": hash_table,
                        "input_ids": input_ids})
    _C.moe_route(use_cuda(dev, op), T, E, k, dtype_code(logits), scale, ptr(logits),
                 E if stride is None else stride,
                 ptr(bias), ptr(hash_table), ptr(input_ids), vocab, ptr(out[0]), ptr(out[1]),
                 stream_of(dev))
    return out
