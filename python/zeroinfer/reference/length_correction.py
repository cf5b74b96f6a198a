"""Reference for correct_lengths, written row by row from the definition in
ops/length_correction.py (plain Python ints: the op is integer bookkeeping)."""

from __future__ import annotations

import torch


def correct_lengths_ref(remap, prev_num_accepted, prev_next_tokens, prev_num_next,
                        assumed_accepted, cu_seqlens_q, seqlens_k, positions, input_ids):
    remap, acc, nxt, nnext, assumed, cu, k, pos, ids = (
        t.cpu().tolist() for t in (remap, prev_num_accepted, prev_next_tokens, prev_num_next,
                                   assumed_accepted, cu_seqlens_q, seqlens_k, positions, input_ids))
    q_out, k_out = [], []
    for i, p in enumerate(remap):
        q_opt = cu[i + 1] - cu[i]
        if p < 0:
            q_out.append(q_opt)
            k_out.append(k[i])
            continue
        delta = acc[p] - assumed[i]
        q = min(q_opt, nnext[p])
        q_out.append(q)
        k_out.append(k[i] + delta - (q_opt - q))
        for j in range(q_opt):
            slot = cu[i] + j
            if j < q:
                pos[slot] += delta
                ids[slot] = nxt[p][j]
            else:
                pos[slot] = -1
                ids[slot] = 0
    i32 = torch.int32
    return (torch.tensor(q_out, dtype=i32), torch.tensor(k_out, dtype=i32),
            torch.tensor(pos, dtype=i32), torch.tensor(ids, dtype=i32))
