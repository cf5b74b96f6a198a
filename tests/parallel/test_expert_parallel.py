"""Expert parallelism on several CPU ranks (gloo, one process each): the MoE token exchange
against a float64 single-device MoE, the model under EP against the model on one device, the
expert moves of a rebalance byte for byte, and a rebalance driven by counted load."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from zeroinfer.model.dummy import dummy_config
from zeroinfer.model.moe import Experts
from zeroinfer.parallel import (
    ExpertParallel,
    Placement,
    initial_placement,
    move_experts,
    num_physical_experts,
    plan_moves,
)
from zeroinfer.parallel.launch import run_ranks
from zeroinfer.reference.moe_gemm import dequantize_expert_f64

pytestmark = pytest.mark.usefixtures("single_torch_thread")

LIMIT = 7.0


def _random_placement(gen, layers, experts, ranks, extra):
    """Every expert once, `extra` random replicas, slots shuffled (replicas on any rank)."""
    P = num_physical_experts(experts, ranks, extra)
    rows = []
    for _ in range(layers):
        row = torch.cat([torch.arange(experts), torch.randint(0, experts, (P - experts,),
                                                              generator=gen)])
        rows.append(row[torch.randperm(P, generator=gen)])
    return Placement.from_phys_to_logical(torch.stack(rows), experts, ranks)


def _expert_weights(gen, E, D, I):  # noqa: E741
    # Random e2m1 bytes, scales near 2^-4 so the products stay O(1).
    u8 = dict(dtype=torch.int32, generator=gen)
    return (torch.randint(0, 256, (E, 2 * I, D // 2), **u8).to(torch.uint8),
            torch.randint(121, 125, (E, 2 * I, D // 32), **u8).to(torch.uint8),
            torch.randint(0, 256, (E, D, I // 2), **u8).to(torch.uint8),
            torch.randint(121, 125, (E, D, I // 32), **u8).to(torch.uint8))


def _moe_f64(x, ids, w, weights):
    """sum_j w[t, j] * down_e(silu(min(gate, L)) * clamp(up, -L, L)), e = ids[t, j], float64."""
    gu = dequantize_expert_f64(weights[0], weights[1])
    dn = dequantize_expert_f64(weights[2], weights[3])
    I = gu.shape[1] // 2  # noqa: E741
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            y = gu[e] @ x[t].double()
            g, u = y[:I].clamp(max=LIMIT), y[I:].clamp(-LIMIT, LIMIT)
            out[t] += float(w[t, j]) * (dn[e] @ (g * torch.sigmoid(g) * u))
    return out


def _layer_worker(rank, world, seed, tokens):
    E, D, I, k = 8, 64, 64, 3  # noqa: E741
    gen = torch.Generator().manual_seed(seed)  # the same weights and placement on every rank
    weights = _expert_weights(gen, E, D, I)
    pl = _random_placement(gen, 1, E, world, extra=4)
    ep = ExpertParallel(pl, load_window=2)
    cfg = replace(dummy_config("tiny"), hidden_size=D, moe_intermediate_size=I,
                  n_routed_experts=E, num_experts_per_tok=k)
    experts = Experts(cfg, ep.slots)
    for buf, full in zip(experts.buffers_of_slots(), weights):
        buf.copy_(full[ep.local_experts()[0]])
    mine = torch.Generator().manual_seed(seed + 1 + rank)  # each rank its own tokens
    T = tokens[rank]
    x = torch.randn(T, D, generator=mine)
    ids = torch.rand(T, E, generator=mine).argsort(1)[:, :k].to(torch.int32)
    w = torch.rand(T, k, generator=mine) + 0.1
    keys = torch.randint(0, 1 << 40, (T,), generator=mine)
    def moe(x, ids, w, keys):
        return ep.run(0, x, ids, w, keys, lambda xs, i, ww: experts.run(xs, i, ww, LIMIT))

    counted = ep.load.current.clone()
    out = moe(x, ids, w, keys)
    counted = ep.load.current - counted
    # The fixed-capacity form (CUDA graphs): C rows on every rank, these T tokens followed by
    # junk padding rows marked invalid, gives the same bits and counts the same load.
    C = max(tokens) + 5
    junk = C - T
    xp = torch.cat([x, torch.randn(junk, D, generator=mine)])
    idsp = torch.cat([ids, torch.randint(0, E, (junk, k), generator=mine, dtype=torch.int32)])
    wp = torch.cat([w, torch.rand(junk, k, generator=mine)])
    keysp = torch.cat([keys, torch.randint(0, 1 << 40, (junk,), generator=mine)])
    valid = torch.arange(C) < T
    before = ep.load.current.clone()
    with ep.fixed_capacity(C, valid):
        fixed = moe(xp, idsp, wp, keysp)
    same_fixed = torch.equal(fixed[:T], out) and torch.equal(ep.load.current - before, counted)
    with ep.fixed_capacity(C, valid, loopback=True):  # no collective: this rank alone
        alone = moe(xp, idsp, wp, keysp)
    assert alone.shape == (C, D)
    # Batch invariance: the same tokens in another order (a rotation; each rank its own, the
    # group in step) give each token the same bits - its replicas follow its key, not its row.
    rot = torch.roll(torch.arange(T), T // 3) if T else torch.arange(0)
    invariant = torch.equal(moe(x[rot], ids[rot], w[rot], keys[rot]), out[rot])
    want = _moe_f64(x, ids, w, weights)
    assert out.shape == (T, D) and out.dtype == torch.float32
    err = float((out.double() - want).abs().max()) if T else 0.0
    scale = float(want.abs().max()) if T else 1.0
    return err, scale, invariant, same_fixed


def test_ep_moe_layer_matches_float64_moe(seed):
    # Rank 0 has no tokens (it only serves the others'); rank 2's batch takes the dispatch
    # path (more than 256 routed rows), rank 1's the routed-layout path.
    errs = run_ranks(_layer_worker, 3, seed, [0, 37, 100])
    for err, scale, invariant, same_fixed in errs:
        assert err <= 1e-4 * max(scale, 1.0), (err, scale)
        assert invariant and same_fixed


def _subgroup_worker(rank, world, seed):
    # Two expert-parallel groups of two ranks each (subgroups of the world, made by every rank
    # in the same order, as torch asks), each with its own placement: every group's exchange
    # and expert moves stay inside it.
    import torch.distributed as dist

    E, D, I, k = 6, 64, 64, 2  # noqa: E741
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    which = rank // 2
    gen = torch.Generator().manual_seed(seed)
    weights = _expert_weights(gen, E, D, I)
    pl = _random_placement(torch.Generator().manual_seed(seed + 1 + which), 1, E, 2, extra=2)
    ep = ExpertParallel(pl, groups[which], load_window=1)
    cfg = replace(dummy_config("tiny"), hidden_size=D, moe_intermediate_size=I,
                  n_routed_experts=E, num_experts_per_tok=k)
    experts = Experts(cfg, ep.slots)
    for buf, full in zip(experts.buffers_of_slots(), weights):
        buf.copy_(full[ep.local_experts()[0]])
    mine = torch.Generator().manual_seed(seed + 10 + rank)
    errs = []
    for _ in range(2):  # before and after a rebalance inside the group
        T = int(torch.randint(0, 9, (1,), generator=mine))
        x = torch.randn(T, D, generator=mine)
        ids = torch.rand(T, E, generator=mine).argsort(1)[:, :k].to(torch.int32)
        w = torch.rand(T, k, generator=mine) + 0.1
        keys = torch.randint(0, 1 << 40, (T,), generator=mine)
        out = ep.run(0, x, ids, w, keys, lambda xs, i, ww: experts.run(xs, i, ww, LIMIT))
        want = _moe_f64(x, ids, w, weights)
        assert out.shape == (T, D)
        if T:
            errs.append(float((out.double() - want).abs().max() / want.abs().max().clamp(min=1)))
        ep.end_step()
        ep.rebalance([experts.buffers_of_slots()])
        for buf, full in zip(experts.buffers_of_slots(), weights):
            assert torch.equal(buf, full[ep.local_experts()[0]])
    return max(errs, default=0.0), ep.placement.phys_to_logical.tolist()


def test_ep_groups_of_a_larger_world(seed):
    res = run_ranks(_subgroup_worker, 4, seed, timeout=120)  # (a hang fails in 2 minutes)
    assert all(err <= 1e-4 for err, _ in res), res
    assert res[0][1] == res[1][1] and res[2][1] == res[3][1]  # each group agrees


def _model_worker(rank, world, seed, lengths, idle_rank):
    from zeroinfer.model import load

    cfg_name = "dummy:tiny"
    full = load(cfg_name)
    c = full.config
    P = num_physical_experts(c.n_routed_experts, world, 2)
    ep = ExpertParallel(initial_placement(c.num_hidden_layers, c.n_routed_experts, P, world),
                        load_window=4)
    m = load(cfg_name, ep=ep)
    gen = torch.Generator().manual_seed(seed + rank)
    results = []

    def round_(n):
        if rank == idle_rank and len(results) == 1:
            m.net.idle_forward()  # this rank sits the second round out, serving the others
            results.append(None)
            return
        prompt = torch.randint(2, c.vocab_size, (n,), generator=gen).tolist()
        got, want = m.logits(prompt), full.logits(prompt)
        results.append(float((got - want).abs().max() / want.abs().max()))

    for n in lengths[rank]:
        round_(n)
        ep.end_step()
    # Batch invariance under EP: a prompt's logits alone and beside another (each rank its own
    # pair, in step), bit for bit - its replicas, so its sum's order, follow the token alone.
    a, b = (torch.randint(2, c.vocab_size, (n,), generator=gen).tolist() for n in (11, 6))
    beside = m.runner(max_seqs=2, max_len=16).step({1: b, 0: a})[0]
    invariant = torch.equal(beside, m.logits(a))
    moved = m.net.rebalance_experts()
    # After the rebalance every slot holds its new expert's bytes, and the logits still match.
    local = ep.local_experts()
    for layer, mod in enumerate(m.net.model.layers):
        mine = mod.mlp.experts.buffers_of_slots()
        ref = full.net.model.layers[layer].mlp.experts.buffers_of_slots()
        for a, b in zip(mine, ref):
            assert torch.equal(a, b[local[layer]])
    round_(lengths[rank][0])
    return results, moved, ep.placement.phys_to_logical.tolist(), ep.load.steps, invariant


def test_ep_model_matches_single_device_and_rebalances(seed):
    world = 2
    res = run_ranks(_model_worker, world, seed, [[5, 9, 3], [12, 4, 7]], 1)
    for errs, moved, _, steps, invariant in res:
        assert steps == 3 and invariant
        assert all(e is None or e < 1e-4 for e in errs), errs
    # Every rank took part and agreed on the new placement (computed from the summed load).
    assert res[0][2] == res[1][2]
    assert res[0][1] == res[1][1]
    assert res[0][1], "the counted load should move some expert off the initial placement"


def _move_worker(rank, world, seed):
    gen = torch.Generator().manual_seed(seed)
    L, E = 3, 7
    old = _random_placement(gen, L, E, world, extra=4)
    new = _random_placement(gen, L, E, world, extra=4)
    # Distinct bytes per (layer, expert): buffers of several shapes and dtypes.
    full = [(torch.randint(0, 256, (E, 5, 6), generator=gen, dtype=torch.int32).to(torch.uint8),
             torch.randn(E, 3, generator=gen).to(torch.bfloat16),
             torch.randn(E, 2, 2, generator=gen)) for _ in range(L)]
    S = old.slots_per_rank
    mine = [tuple(t[old.local_experts(rank)[layer]].clone() for t in full[layer])
            for layer in range(L)]
    received = move_experts(mine, old, new, rank)
    for layer in range(L):
        want = new.local_experts(rank)[layer]
        for got, ref in zip(mine[layer], full[layer]):
            assert got.shape[0] == S and torch.equal(got, ref[want])
    planned = sum(q == rank for layer in range(L) for _, q, _ in plan_moves(old, new, layer))
    return received, planned


@pytest.mark.parametrize("world", [2, 3])
def test_move_experts_rewrites_every_slot(seed, world):
    for received, planned in run_ranks(_move_worker, world, seed):
        assert received == planned


def test_plan_moves_spreads_senders():
    # Expert 0 is on ranks 0 and 1 and moves to ranks 2 and 3: one copy from each holder.
    old = Placement.from_phys_to_logical(torch.tensor([[0, 1, 0, 2, 3, 4, 5, 6]]), 7, 4)
    new = Placement.from_phys_to_logical(torch.tensor([[1, 2, 3, 4, 0, 5, 0, 6]]), 7, 4)
    moves = plan_moves(old, new, 0)
    assert [(e, q, h) for e, q, h in moves if e == 0] == [(0, 2, 0), (0, 3, 1)]
    # every (rank, expert) that is new to the rank is planned exactly once
    S = 2
    for r in range(4):
        was, now = set(old.local_experts(r)[0].tolist()), set(new.local_experts(r)[0].tolist())
        assert sorted(e for e, q, _ in moves if q == r) == sorted(now - was)
    assert all(h != q for _, q, h in moves) and S == new.slots_per_rank


def _one_rank_worker(rank, world, device, seed):
    from zeroinfer import LLM, SamplingParams
    from zeroinfer.model import load, model_config

    name = "dummy:tiny"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    # (rebalanced every 3 engine rounds: the graphs must then be recaptured, or they would
    # read the old replica tables and prepacked weights. On one rank every placement balances
    # alike, so the balancer would keep the current one: take its fresh placements instead, to
    # exercise the moves.)
    import zeroinfer.parallel.expert_parallel as ep_module
    from zeroinfer.parallel import eplb

    ep_module.rebalance = lambda load, p, n, current=None: eplb.rebalance(load, p, n)
    ep = ExpertParallel.for_model(model_config(name), redundant_experts=3, device=device,
                                  load_window=1, rebalance_interval=3)
    m, full = load(name, dtype=dtype, device=device, ep=ep), load(name, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed)
    c = full.config
    prompt = torch.randint(2, c.vocab_size, (40,), generator=gen).tolist()
    same_logits = torch.equal(m.logits(prompt), full.logits(prompt))
    # A decode step of 3 sequences in the fixed shapes (a class of 4 rows: one padding row)
    # counts the load of the 3 tokens alone.
    r = m.runner(max_seqs=3, max_len=48, decode_graphs=True)
    r.step({s: prompt[s:s + 5] for s in range(3)})
    before = int(ep.load.current.sum())
    r.step({s: [prompt[s]] for s in range(3)})
    counted = int(ep.load.current.sum()) - before == 3 * c.num_experts_per_tok * sum(
        layer.mlp.ep is not None for layer in m.net.model.layers)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [prompt[:7], prompt[5:30], prompt[1:4]]
    same_tokens = []
    for graphs in (False, True):  # eager; decode graphs (CUDA: captured NCCL collectives)
        kw = dict(tokenizer=None, max_num_seqs=4, max_model_len=96, decode_graphs=graphs,
                  dtype=dtype, device=device)
        got = [o.token_ids
               for o in LLM(name, ep=ep, **kw).generate(prompts, params, use_tqdm=False)]
        want = [o.token_ids for o in LLM(name, **kw).generate(prompts, params, use_tqdm=False)]
        same_tokens.append(got == want)
    start = initial_placement(c.num_hidden_layers, c.n_routed_experts, ep.placement.num_physical,
                              1)
    moved = not torch.equal(ep.placement.phys_to_logical.cpu(), start.phys_to_logical)
    return same_logits, counted and moved, same_tokens


def test_one_rank_ep_is_bitwise_the_single_device_model(seed):
    # One rank holds every expert (with replicas): each token's experts are summed on it in
    # slot order, as on one device, so the logits agree bit for bit.
    assert run_ranks(_one_rank_worker, 1, "cpu", seed) == [(True, True, [True, True])]


@pytest.mark.gpu
def test_one_rank_ep_on_cuda_over_nccl(seed):
    # The exchange's CUDA paths on one GPU: NCCL all-to-all with byte views of bf16 rows, and
    # the fixed-capacity form's collectives captured in the decode graphs and replayed.
    assert run_ranks(_one_rank_worker, 1, "cuda", seed, backend="nccl") == [
        (True, True, [True, True])]


def _checkpoint_worker(rank, world, seed, path):
    from zeroinfer.model import load

    full = load(path)
    c = full.config
    gen = torch.Generator().manual_seed(seed)  # the same placement on every rank
    pl = _random_placement(gen, c.num_hidden_layers, c.n_routed_experts, world, extra=3)
    ep = ExpertParallel(pl)
    m = load(path, ep=ep)
    local = ep.local_experts()
    for layer, mod in enumerate(m.net.model.layers):
        mine = mod.mlp.experts.buffers_of_slots()
        ref = full.net.model.layers[layer].mlp.experts.buffers_of_slots()
        for a, b in zip(mine, ref):
            assert torch.equal(a, b[local[layer]]), (rank, layer)
    prompt = torch.randint(2, c.vocab_size, (9 + rank,), generator=gen).tolist()
    got, want = m.logits(prompt), full.logits(prompt)
    return float((got - want).abs().max() / want.abs().max())


def test_ep_ranks_load_their_experts_from_a_checkpoint(seed, tmp_path):
    # Each rank reads only its slots' experts from the safetensors files (replicas and a
    # shuffled placement included): its buffers are the full load's rows, and the EP model's
    # logits match the single-device model's.
    from zeroinfer.model.dummy import random_state_dict
    from zeroinfer.model.weights import save_checkpoint

    cfg = dummy_config("tiny")
    path = save_checkpoint(tmp_path / "ckpt", random_state_dict(cfg, seed), cfg)
    errs = run_ranks(_checkpoint_worker, 2, seed, str(path))
    assert all(e < 1e-4 for e in errs), errs
