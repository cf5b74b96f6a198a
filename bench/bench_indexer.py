"""Benchmark indexer_scores (the lightning indexer's scores over the paged index-key cache) at
V4-Flash's indexer shapes - 64 heads of 128 channels, bf16 keys in 64-entry blocks - against the
batched torch path (gather the keys, one bmm, ReLU, weighted head sum, mask).

  python bench/bench_indexer.py                 # CPU twin (float32 keys) vs torch
  python bench/bench_indexer.py --device cuda   # CUDA kernel (bf16 keys) vs torch

Decode: one query token a sequence, each sequence holding n entries (a context of 4n tokens:
CSA's rate 4), batch 1-128. q is bf16-exact, as the model's is on the GPU (one MMA a tile on
tensor cores); one row (`q` = float32) has q not bf16-exact, which costs the kernel a second MMA
for q's low half. Prefill: one sequence's 4096-token chunk, each token seeing the
entries closed at its position. `time_us` the eager call with the L2 flushed, `kernel_us` its
device work (CUPTI); `bytes` the keys of every token's sequence (the decode rows read each
sequence's keys once), q, weights and the scores written; `flops` 2 x heads x d a visible
(token, entry) pair. On CUDA the bf16 keys take the tensor-core kernel (mma.sync); on the CPU
the twin runs float32 on vector units, so its fractions are of no floor.
"""

from __future__ import annotations

import torch

from zeroinfer.ops import indexer_scores
from zeroinfer.testing import bench

HEADS, DIM, BLOCK = 64, 128, 64


def torch_scores(q, w, keys, table, seq, visible, n, scale):
    """The batched torch path, float32: each token's sequence's keys gathered [T, n, d]."""
    s = torch.arange(n, device=q.device)
    slots = table[seq][:, s // BLOCK].long().clamp(min=0) * BLOCK + s % BLOCK
    k = keys.view(-1, keys.shape[-1])[slots].float()
    dots = torch.relu(torch.bmm(q, k.transpose(1, 2)))  # [T, H, n]
    scores = (dots * w[:, :, None]).sum(1) * scale
    return scores.masked_fill(s[None, :] >= visible[:, None], float("-inf"))


def case(gen, dev, key_dtype, *, seqs, tokens, entries, first_pos=None, q_exact=True):
    """Keys of `seqs` sequences of `entries` entries in shuffled blocks; `tokens` queries (one a
    sequence for decode; first_pos: one sequence's chunk from that position, causal)."""
    blocks = (entries + BLOCK - 1) // BLOCK
    keys = torch.randn(seqs * blocks, BLOCK, DIM, generator=gen).to(dev, key_dtype)
    table = torch.randperm(seqs * blocks, generator=gen).view(seqs, blocks).int().to(dev)
    if first_pos is None:
        seq = torch.arange(tokens, device=dev)
        visible = torch.full((tokens,), entries, device=dev)
    else:
        seq = torch.zeros(tokens, dtype=torch.int64, device=dev)
        visible = (first_pos + torch.arange(tokens, device=dev) + 1) // 4
    q = torch.randn(tokens, HEADS, DIM, generator=gen)
    q = (q.bfloat16().float() if q_exact else q).to(dev)
    w = torch.randn(tokens, HEADS, generator=gen).to(dev) * HEADS**-0.5
    return q, w, keys, table, seq, visible


def main() -> None:
    args = bench.parse_args(__doc__)
    dev = args.device
    cuda = dev == "cuda"
    key_dtype = torch.bfloat16 if cuda else torch.float32
    ceilings = bench.measure_cuda_ceilings() if cuda else None
    gen = torch.Generator().manual_seed(0)
    scale = DIM**-0.5
    decode = [(b, n) for b in (1, 8, 32, 128) for n in (2048, 8192, 32768)] if cuda else \
        [(1, 512), (8, 512), (1, 2048)]
    prefill = [(4096, 1024, 0), (4096, 8192, 28672)] if cuda else [(256, 64, 0)]
    shapes = [("decode", b, b, n, None, True) for b, n in decode] + \
        [("prefill", 1, t, n, p, True) for t, n, p in prefill] + \
        ([("decode", 32, 32, 8192, None, False)] if cuda else [])
    rows = []
    for kind, seqs, tokens, n, first, q_exact in shapes:
        q, w, keys, table, seq, visible = case(gen, dev, key_dtype, seqs=seqs, tokens=tokens,
                                               entries=n, first_pos=first, q_exact=q_exact)
        call = lambda: indexer_scores(q, w, keys, table, seq, visible, n, scale=scale)  # noqa: E731
        got = call()
        pairs = int(visible.clamp(max=n).sum())
        gathered = tokens * n * (DIM + HEADS) * 4  # the torch path's [T, n, d] and [T, H, n]
        fits = gathered < (8 << 30 if cuda else 1 << 30)
        if fits:  # a fast wrong kernel must not post a number
            ref = torch_scores(q, w, keys, table, seq, visible, n, scale)
            err = (got - ref).abs()[visible.clamp(max=n)[:, None] > torch.arange(n, device=dev)]
            bound = 1e-3 * float(ref[ref.isfinite()].abs().max())
            assert float(err.max()) <= bound, float(err.max())
        key_bytes = seqs * n * DIM * keys.element_size()
        bytes_moved = key_bytes + q.numel() * 4 + w.numel() * 4 + tokens * n * 4
        timer = bench.time_cuda if cuda else bench.time_cpu
        row = bench.roofline_row(seconds=timer(call), bytes_moved=bytes_moved,
                                 flops=2 * HEADS * DIM * pairs, ceilings=ceilings,
                                 kernel_seconds=bench.time_kernels(call) if cuda else None)
        if fits:
            t_torch = timer(lambda: torch_scores(q, w, keys, table, seq, visible, n, scale))
            row.update(torch_us=t_torch * 1e6, speedup_vs_torch=t_torch / (row["time_us"] / 1e6))
        rows.append({"kind": kind, "q": "bf16-exact" if q_exact else "float32", "seqs": seqs,
                     "tokens": tokens, "entries": n, "heads": HEADS,
                     "dim": DIM, "key_dtype": str(key_dtype).split(".")[1], **row})
        del q, w, keys, table, seq, visible, got
    cols = ["kind", "q", "seqs", "tokens", "entries", "bytes", "flops", "time_us"]
    cols += ["kernel_us", "gbps", "tflops", "kernel_fraction_of_floor"] if cuda else \
        ["gbps", "tflops"]
    bench.print_table(rows, cols + ["torch_us", "speedup_vs_torch"])
    extra = {"ceilings": ceilings,
             "timing": "time_us: eager call, CUDA events, L2 flushed before each; kernel_us: its "
                       "device work (CUPTI); torch_us: the batched torch path (float32)"} \
        if cuda else None
    path = bench.write_results("indexer", rows, device=dev, extra=extra, out_dir=args.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
