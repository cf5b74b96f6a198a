"""Decode steps in fixed shapes (ForwardBatch.decode, model/decode_graph.py) against the
variable-shape forward: the same logits and the same cache contents, step after step, with
rows that come and go (padding rows), windows that close at both compression rates, and
sequences at every distance from their first window. On the CPU the fixed-shape forward runs
eagerly and must give the eager path's bits; on a GPU it runs from CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from zeroinfer.model import load
from zeroinfer.model.decode_graph import (ROW_BUCKETS, DecodeGraphs, FixedStep, captured_classes,
                                          graph_captures, row_bucket, width_bucket)


def _caches_real(runner):
    """Every pool's blocks and every compressor's ring, scratch left out (the decode form
    writes its discards there)."""
    out = []
    for c in runner.caches:
        for pool in (c.window, c.comp, c.index):
            if pool is not None:
                out.append(pool[:-1])
        for st in c.state.values():
            out += [st.kv[:-1], st.gate[:-1]]
    return out


def _drive(model, gen, steps: int, check, kv_fp8: bool = False, drafts: int = 0):
    """Two runners over one model, eager and decode-graph: random prompts (1-30 tokens; the
    first shorter than a CSA window) for four sequences, then `steps` decode steps, each with
    a random subset of them (so the row bucket changes and padding rows appear);
    check(eager_logits, graph_logits) each step. drafts > 0: about half the steps are
    speculative verification rows (the greedy token and `drafts` random drafts a row), of
    which a random number are then taken back (PagedRunner.discard, the same in both)."""
    c = model.config
    V = c.vocab_size
    kw = dict(max_seqs=4, max_len=40 + steps * (1 + drafts), kv_fp8=kv_fp8, max_discard=drafts)
    eager, graphs = model.runner(**kw), model.runner(decode_graphs=True, **kw)
    # sequence 0's prompt is shorter than a CSA window: its first windows close in decode
    longest = [c.csa_rate, 31, 31, 31]
    feeds = {s: torch.randint(0, V, (int(torch.randint(1, longest[s], (1,), generator=gen)),),
                              generator=gen).tolist() for s in range(4)}
    last = eager.step(feeds)
    graphs.step(feeds)
    for _ in range(steps):
        live = [s for s in range(4) if s == 0 or torch.rand(1, generator=gen) < 0.7]
        verify = drafts and torch.rand(1, generator=gen) < 0.5
        extra = drafts if verify else 0
        feed = {s: [int(last[s][-1].argmax()) if s in last else 1]
                + torch.randint(0, V, (extra,), generator=gen).tolist() for s in live}
        a, b = eager.step(feed), graphs.step(feed)
        for s in live:
            check(a[s], b[s])
            gone = int(torch.randint(0, extra + 1, (1,), generator=gen))
            eager.discard(s, gone)
            graphs.discard(s, gone)
            last[s] = a[s][:a[s].shape[0] - gone]
    return eager, graphs


@pytest.mark.parametrize("drafts", [0, 5], ids=["decode", "verify"])
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["float-cache", "fp8-cache"])
def test_decode_graph_bits_equal_eager(gen, torch_threads, kv_fp8, drafts):
    """The fixed-shape form against the variable-shape forward, bitwise: one-token rows, and
    verification rows of 1 + 5 tokens (more than a CSA window) with some taken back."""
    model = load("dummy:tiny-yarn", seed=int(torch.randint(0, 1000, (1,), generator=gen)))
    c = model.config
    steps = 3 * c.hca_rate + 5  # every sequence closes windows of both rates, some twice

    def check(a, b):
        assert torch.equal(a, b)

    eager, graphs = _drive(model, gen, steps, check, kv_fp8, drafts)
    for x, y in zip(_caches_real(eager), _caches_real(graphs)):
        assert torch.equal(x, y)
    assert graphs.graphs.steps, "the decode-graph runner never took its fixed-shape path"
    assert {k[1] for k in graphs.graphs.steps} == ({1, 1 + drafts} if drafts else {1})


@pytest.mark.parametrize("tokens", [1, 6])
def test_padding_rows_write_only_scratch(gen, tokens):
    """A step of padding rows alone (what a graph is captured on) changes no cache outside
    scratch, with one token a row or a verification row's six (more than a CSA window: its
    tokens must close none); and the buckets cover what they promise."""
    model = load("dummy:tiny", seed=int(torch.randint(0, 1000, (1,), generator=gen)))
    r = model.runner(max_seqs=3, max_len=48)
    r.step({s: torch.randint(0, model.config.vocab_size, (9 + 7 * s,), generator=gen).tolist()
            for s in range(3)})
    before = [t.clone() for t in _caches_real(r)]
    dg = DecodeGraphs(model.net, r.caches, "cpu")
    step = FixedStep(4, tokens, {"window": 4, "csa": 2, "hca": 2}, torch.device("cpu"))
    dg._fill(step, [], [], [], {"window": [], "csa": [], "hca": []})
    logits = model.net(step.batch(), r.caches)
    assert torch.isfinite(logits).all()
    for x, y in zip(before, _caches_real(r)):
        assert torch.equal(x, y)
    for n in range(1, ROW_BUCKETS[-1] + 1):
        b = row_bucket(n)
        assert b >= n and b in ROW_BUCKETS
    with pytest.raises(ValueError, match="exceed the largest bucket"):
        row_bucket(ROW_BUCKETS[-1] + 1)
    assert [width_bucket(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]


@pytest.mark.gpu
@pytest.mark.parametrize("drafts", [0, 4], ids=["decode", "verify"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_decode_graphs_match_eager(gen, dtype, drafts):
    """CUDA graphs replay the fixed-shape step - one token a row, or verification rows of
    1 + 4 tokens with some taken back; against the eager variable-shape step the logits agree
    within the dtype's rounding (the attention's index lists are wider, so its split and sums
    may differ in the last bits). Each class is captured once, on its first step, and
    replayed after (graph_captures counts the captures)."""
    model = load("dummy:tiny-yarn", dtype=dtype, device="cuda",
                 seed=int(torch.randint(0, 1000, (1,), generator=gen)))
    captures0 = graph_captures()
    tol = 2e-3 if dtype == torch.float32 else 6e-2
    worst = []

    def check(a, b):
        worst.append(float((a - b).abs().max() / a.abs().max().clamp(min=1e-6)))

    _, graphs = _drive(model, gen, 2 * model.config.hca_rate + 3, check, drafts=drafts)
    assert max(worst) < tol, max(worst)
    if drafts:
        assert any(k[1] == 1 + drafts for k in graphs.graphs.steps)
    assert all(s.graph is not None for s in graphs.graphs.steps.values())
    assert len(graphs.graphs.steps) >= 2  # the row bucket changed, and each class has a graph
    assert graph_captures() - captures0 == len(graphs.graphs.steps)
    assert sorted(captured_classes(captures0)) == sorted(
        f"decode {s.key}" for s in graphs.graphs.steps.values())


def test_padding_step_classes_made_under_inference_mode_serve_later_steps(gen):
    """An expert-parallel rank may first meet a class in a step of padding alone, run under
    inference mode (ModelRunner.run_in_order); the class's inputs are refilled outside it."""
    model = load("dummy:tiny", seed=int(torch.randint(0, 1000, (1,), generator=gen)))
    r = model.runner(max_seqs=2, max_len=32)
    dg = DecodeGraphs(model.net, r.caches, "cpu")
    empty = {"window": [], "csa": [], "hca": []}
    with torch.inference_mode():
        first = dg.run([], [], [], empty, rows=3)
    again = dg.run([], [], [], empty, rows=3)
    assert first.shape == again.shape == (0, model.config.vocab_size)
    assert list(dg.steps) == [(4, 1, (1, 1, 1))]
    with pytest.raises(ValueError, match="rows must be in"):
        dg.run([5], [3], [0], empty, rows=ROW_BUCKETS[-1] + 1)
