"""correct_lengths against its reference and against the truth of a simulated scheduler."""

from __future__ import annotations

import pytest
import torch

from zeroinfer.ops import CorrectedLengths, correct_lengths, correct_lengths_ref

I32 = torch.int32


def random_round(gen, R, R_prev, S, *, fresh=0.3):
    """A random but valid pair of rounds: round N+1 rows remapped onto a shuffled subset of
    round N's rows, optimistic lengths, and round N's real results."""
    ri = lambda lo, hi, *s: torch.randint(lo, hi, s, generator=gen, dtype=I32)  # noqa: E731
    remap = torch.full((R,), -1, dtype=I32)
    matched = torch.rand(R, generator=gen) >= fresh
    perm = torch.randperm(R_prev, generator=gen)[: int(matched.sum())].to(I32)
    remap[torch.nonzero(matched).flatten()[: perm.numel()]] = perm
    q_opt = ri(0, S + 2, R)
    cu = torch.zeros(R + 1, dtype=I32)
    cu[1:] = torch.cumsum(q_opt, 0)
    n = int(cu[-1])
    return dict(
        remap=remap,
        prev_num_accepted=ri(1, S + 1, R_prev),
        prev_next_tokens=ri(0, 129280, R_prev, S),
        prev_num_next=ri(0, S + 1, R_prev),
        assumed_accepted=ri(S, S + 2, R),
        cu_seqlens_q=cu,
        seqlens_k=ri(S + 2, 5000, R),
        positions=ri(0, 5000, n),
        input_ids=ri(0, 129280, n),
    )


def poisoned_out(args, device="cpu"):
    return CorrectedLengths(*(torch.full_like(args[k], -12345, device=device)
                              for k in ("remap", "seqlens_k", "positions", "input_ids")))


@pytest.mark.parametrize("R,R_prev,S", [(0, 0, 1), (0, 3, 2), (1, 1, 1), (5, 9, 3), (64, 64, 1),
                                        (200, 150, 6), (1500, 1400, 2)])
def test_matches_reference(gen, R, R_prev, S):
    args = random_round(gen, R, R_prev, S)
    out = correct_lengths(**args, out=poisoned_out(args))
    ref = correct_lengths_ref(**args)
    for name, got, want in zip(CorrectedLengths._fields, out, ref):
        assert torch.equal(got, want), name


def test_inputs_are_not_modified(gen):
    args = random_round(gen, 50, 50, 4)
    before = {k: v.clone() for k, v in args.items()}
    correct_lengths(**args)
    assert all(torch.equal(before[k], args[k]) for k in args)


def test_simulated_speculative_rounds_recover_the_truth(gen):
    """Independent oracle: requests with true committed lengths C. Round N commits a_i tokens
    (1 + accepted drafts); the CPU laid out round N+1 assuming nextn+1, with rows reordered and
    new requests mixed in. After correction every position and key length equals the truth."""
    nextn, R_prev = 3, 40
    C = torch.randint(10, 1000, (R_prev,), generator=gen)
    accepted = torch.randint(1, nextn + 2, (R_prev,), generator=gen)  # tokens committed in N
    next_tokens = torch.randint(0, 1000, (R_prev, nextn + 1), generator=gen)  # [bonus, drafts]
    order = torch.randperm(R_prev, generator=gen)[:30]  # 30 survive, reordered (e.g. by length)
    fresh_len = [7, 1, 12]  # three prefill chunks that the CPU knows exactly
    remap, cu, k_opt, pos, ids, true_pos, true_k, true_ids = [], [0], [], [], [], [], [], []
    for p in order.tolist():
        q = nextn + 1
        base = int(C[p]) + nextn + 1  # the CPU assumes every draft is accepted
        remap.append(p)
        cu.append(cu[-1] + q)
        k_opt.append(base + q)
        pos += list(range(base, base + q))
        ids += [0] * q  # unknown on the CPU
        real = int(C[p]) + int(accepted[p])
        true_k.append(real + q)
        true_pos += list(range(real, real + q))
        true_ids += next_tokens[p].tolist()
    for n in fresh_len:
        start = int(torch.randint(0, 100, (1,), generator=gen))
        remap.append(-1)
        cu.append(cu[-1] + n)
        k_opt.append(start + n)
        pos += list(range(start, start + n))
        tok = torch.randint(0, 1000, (n,), generator=gen).tolist()
        ids += tok
        true_k.append(start + n)
        true_pos += list(range(start, start + n))
        true_ids += tok
    t = lambda v: torch.tensor(v, dtype=I32)  # noqa: E731
    out = correct_lengths(
        remap=t(remap), prev_num_accepted=accepted.to(I32), prev_next_tokens=next_tokens.to(I32),
        prev_num_next=torch.full((R_prev,), nextn + 1, dtype=I32),
        assumed_accepted=torch.full((len(remap),), nextn + 1, dtype=I32), cu_seqlens_q=t(cu),
        seqlens_k=t(k_opt), positions=t(pos), input_ids=t(ids))
    assert out.positions.tolist() == true_pos
    assert out.seqlens_k.tolist() == true_k
    assert out.input_ids.tolist() == true_ids
    assert out.seqlens_q.tolist() == [cu[i + 1] - cu[i] for i in range(len(remap))]


def test_short_next_rows_leave_unused_slots(gen):
    """A previous row that produced fewer next tokens than the slots reserved: the tail slots
    are marked unused (position -1) and the key length shrinks accordingly."""
    args = dict(remap=torch.tensor([0], dtype=I32), prev_num_accepted=torch.tensor([2], dtype=I32),
                prev_next_tokens=torch.tensor([[11, 12, 13]], dtype=I32),
                prev_num_next=torch.tensor([1], dtype=I32),
                assumed_accepted=torch.tensor([3], dtype=I32),
                cu_seqlens_q=torch.tensor([0, 3], dtype=I32), seqlens_k=torch.tensor([103], dtype=I32),
                positions=torch.tensor([100, 101, 102], dtype=I32),
                input_ids=torch.tensor([0, 0, 0], dtype=I32))
    out = correct_lengths(**args)
    assert out.seqlens_q.tolist() == [1] and out.seqlens_k.tolist() == [100]
    assert out.positions.tolist() == [99, -1, -1] and out.input_ids.tolist() == [11, 0, 0]


def test_rejects_bad_input(gen):
    args = random_round(gen, 6, 5, 2, fresh=0.0)
    while int(args["cu_seqlens_q"][-1]) < 2:  # (a strided view of < 2 tokens is contiguous)
        args = random_round(gen, 6, 5, 2, fresh=0.0)

    def call(**over):
        return correct_lengths(**{**args, **over})

    with pytest.raises(TypeError, match="remap must have dtype int32"):
        call(remap=args["remap"].long())
    with pytest.raises(ValueError, match="remap values must be -1 or a row of round N"):
        call(remap=torch.full_like(args["remap"], 5))
    with pytest.raises(ValueError, match="prev_num_accepted must have shape"):
        call(prev_num_accepted=args["prev_num_accepted"][:-1])
    with pytest.raises(ValueError, match="prev_next_tokens must be 2-D"):
        call(prev_next_tokens=args["prev_next_tokens"].flatten())
    with pytest.raises(ValueError, match="prev_num_next values must be in"):
        call(prev_num_next=args["prev_num_next"] + 3)
    with pytest.raises(ValueError, match="assumed_accepted must have shape"):
        call(assumed_accepted=args["assumed_accepted"][:2])
    with pytest.raises(ValueError, match="cu_seqlens_q must have shape"):
        call(cu_seqlens_q=args["cu_seqlens_q"][:-1])
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        call(cu_seqlens_q=args["cu_seqlens_q"].flip(0).contiguous())
    with pytest.raises(ValueError, match="input_ids must have shape"):
        call(input_ids=args["input_ids"][:-1])
    with pytest.raises(ValueError, match="seqlens_k must be on"):
        call(seqlens_k=args["seqlens_k"].to("meta"))
    with pytest.raises(ValueError, match="positions must be contiguous"):
        call(positions=torch.stack([args["positions"]] * 2, 1)[:, 0])
    with pytest.raises(TypeError, match="out.seqlens_k must have dtype"):
        o = poisoned_out(args)
        call(out=o._replace(seqlens_k=o.seqlens_k.long()))


@pytest.mark.gpu
@pytest.mark.parametrize("R,R_prev,S", [(0, 0, 1), (1, 1, 1), (256, 256, 1), (300, 280, 6),
                                        (4096, 4000, 3)])
def test_cuda_matches_cpu(gen, R, R_prev, S):
    args = random_round(gen, R, R_prev, S)
    cpu = correct_lengths(**args)
    dev = {k: v.cuda() for k, v in args.items()}
    got = correct_lengths(**dev, out=poisoned_out(args, device="cuda"), check=True)
    for name, g, c in zip(CorrectedLengths._fields, got, cpu):
        assert torch.equal(g.cpu(), c), name
