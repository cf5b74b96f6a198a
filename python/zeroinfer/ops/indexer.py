"""The lightning indexer's scores over the paged index-key cache (V4's CSA layers), one launch
for every query token of a batch. Token t of sequence seq[t] sees that sequence's first
visible[t] compressed entries (clamped to [0, num_entries]):

    score(t, s) = scale * sum_h weights[t, h] * relu(q[t, h] . key(seq[t], s))   s < visible[t]
    score(t, s) = -inf                                                           otherwise

with key(b, s) in cache slot block_table[b, s // block_size] * block_size + s % block_size.

Every sum runs in one fixed order (each dot over the channels ascending, then the heads
ascending, the product by `scale` last), each product and sum rounded on its own: a row's scores
depend on its own inputs alone, whatever else shares the batch, so the top-k the model picks
from them is batch-invariant; the CPU twin and the CUDA kernel agree bitwise. On CUDA, bfloat16
keys with d a multiple of 16 up to 128 (V4's 128) run on tensor cores instead: q split into two
bf16 halves where it is not bf16-exact, float32 accumulation in the MMA's order - float32
accuracy, one fixed order for every row (batch-invariant, deterministic), not the CPU's bits.
relu keeps NaN. A
sequence index outside the table or a negative cache block below visible[t] gives NaN for those
entries (on CUDA the values are not checked: that would need a host synchronisation).
"""

from __future__ import annotations

import torch

from zeroinfer import _C
from zeroinfer.ops._backend import dtype_code, ptr, stream_of, use_cuda
from zeroinfer.ops._checks import check_float, check_no_alias, check_positive_int, check_tensor


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                   block_table: torch.Tensor, seq_of_token: torch.Tensor, visible: torch.Tensor,
                   num_entries: int, *, scale: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Scores [T, num_entries] float32 (definition in the module doc).

    q [T, H, d] and weights [T, H]: float32. keys [num_blocks, block_size, d]: the paged cache,
    float32 or bfloat16. block_table [B, max_blocks] int32, with num_entries <= max_blocks *
    block_size. seq_of_token [T] and visible [T]: int32 or int64, one dtype. All contiguous, on
    one device. Returns a new tensor, or fills `out` (float32 [T, num_entries], overlapping no
    input).
    """
    op = "indexer_scores"
    check_tensor(op, "q", q, dtypes=(torch.float32,), ndim=3)
    dev = q.device
    T, H, d = q.shape
    check_tensor(op, "weights", weights, dtypes=(torch.float32,), shape=(T, H), device=dev)
    check_tensor(op, "keys", keys, dtypes=(torch.float32, torch.bfloat16), shape=(None, None, d),
                 device=dev)
    check_tensor(op, "block_table", block_table, dtypes=(torch.int32,), ndim=2, device=dev)
    check_tensor(op, "seq_of_token", seq_of_token, dtypes=(torch.int32, torch.int64), shape=(T,),
                 device=dev)
    check_tensor(op, "visible", visible, dtypes=(seq_of_token.dtype,), shape=(T,), device=dev)
    check_positive_int(op, "num_entries", num_entries, minimum=0)
    scale = check_float(op, "scale", scale)
    if H < 1 or d < 1:
        raise ValueError(f"{op}: q must have at least one head and one channel, got "
                         f"{tuple(q.shape)}")
    num_seqs, max_blocks = block_table.shape
    block_size = keys.shape[1]
    if block_size < 1:
        raise ValueError(f"{op}: keys must have a block size >= 1, got shape {tuple(keys.shape)}")
    if num_entries > max_blocks * block_size:
        raise ValueError(f"{op}: num_entries ({num_entries}) exceeds what block_table covers "
                         f"({max_blocks} blocks x {block_size} entries)")
    if T and not q.is_cuda:  # (on CUDA this would synchronise the host: NaN scores instead)
        if int(seq_of_token.min()) < 0 or int(seq_of_token.max()) >= num_seqs:
            raise ValueError(f"{op}: seq_of_token must index block_table's {num_seqs} rows, got "
                             f"values in [{int(seq_of_token.min())}, {int(seq_of_token.max())}]")
        # The kernel is not told how many blocks keys has: every table entry a token reads (its
        # sequence's blocks below visible[t]) must be one (negative ones give NaN, by contract).
        num_blocks = keys.shape[0]
        reads = (visible.clamp(0, num_entries) + block_size - 1) // block_size  # [T]
        rows = block_table[seq_of_token.long()]  # [T, max_blocks]
        bad = (torch.arange(max_blocks)[None, :] < reads[:, None]) & (rows >= num_blocks)
        if bool(bad.any()):
            t, j = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"{op}: block_table[{int(seq_of_token[t])}, {j}] = {int(rows[t, j])} "
                             f"(read by token {t}) must be a block of keys, < keys.shape[0] = "
                             f"{num_blocks} (or negative: NaN scores)")
    if out is None:
        out = torch.empty(T, num_entries, dtype=torch.float32, device=dev)
    else:
        check_tensor(op, "out", out, dtypes=(torch.float32,), shape=(T, num_entries), device=dev)
        check_no_alias(op, {"out": out}, {"q": q, "weights": weights, "keys": keys,
                                          "block_table": block_table,
                                          "seq_of_token": seq_of_token, "visible": visible})
    _C.indexer_scores(use_cuda(dev, op), T, H, d, num_entries, num_seqs, max_blocks, block_size,
                      dtype_code(keys), seq_of_token.dtype == torch.int64, scale, ptr(q),
                      ptr(weights), ptr(keys), ptr(block_table), ptr(seq_of_token), ptr(visible),
                      ptr(out), stream_of(dev))
    return out
