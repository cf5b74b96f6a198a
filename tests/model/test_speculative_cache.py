"""Taking speculative tokens back (PagedRunner.discard): a runner that verifies random drafts
and keeps a random prefix of each step must give, for the kept tokens, the logits of a runner
that was fed only those tokens. Nothing is restored on a discard - the window K=V, compressed
entries, indexer keys and compressor rings of rejected positions are written again when the
kept tokens reach them - so this holds only if every read of a later step sees kept tokens
alone."""

from __future__ import annotations

import pytest
import torch

from zeroinfer.model import load


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "fixed-shape"])
def test_discarded_drafts_leave_no_trace(gen, graphs):
    model = load("dummy:tiny-yarn", seed=int(torch.randint(0, 1000, (1,), generator=gen)))
    V, D, n = model.config.vocab_size, 4, 3
    spec = model.runner(max_seqs=n, max_len=200, max_discard=D, decode_graphs=graphs)
    clean = model.runner(max_seqs=n, max_len=200)
    prompts = {s: torch.randint(0, V, (int(torch.randint(1, 12, (1,), generator=gen)),),
                                generator=gen).tolist() for s in range(n)}
    want = clean.step(prompts)
    got = spec.step(prompts)
    kept_total = 0
    for _ in range(30):
        # every row the same length, so the fixed-shape runner takes its verification form
        d = int(torch.randint(0, D + 1, (1,), generator=gen))
        feeds, keep = {}, {}
        for s in range(n):
            nxt = int(want[s][-1].argmax())
            feeds[s] = [nxt] + torch.randint(0, V, (d,), generator=gen).tolist()
            keep[s] = 1 + int(torch.randint(0, d + 1, (1,), generator=gen))
        got = spec.step(feeds)
        for s in range(n):
            spec.discard(s, d + 1 - keep[s])
        want = clean.step({s: feeds[s][:keep[s]] for s in range(n)})
        for s in range(n):
            torch.testing.assert_close(got[s][:keep[s]], want[s], rtol=1e-4, atol=1e-4)
            kept_total += keep[s]
        assert spec.lengths == clean.lengths
    assert kept_total > 30 * n  # some drafts were kept, some not
    if graphs:
        assert any(k[1] > 1 for k in spec.graphs.steps)


def test_discard_bounds(gen):
    model = load("dummy:tiny", seed=1)
    r = model.runner(max_seqs=2, max_len=64, max_discard=3)
    r.step({0: [5, 6, 7], 1: [1, 2, 3, 4, 5, 6]})
    with pytest.raises(ValueError, match="can discard 0 .. 3"):
        r.discard(1, 4)  # more than max_discard
    r.step({0: [8, 9]})
    with pytest.raises(ValueError, match="can discard 0 .. 2"):
        r.discard(0, 3)  # more than its last step wrote
    r.discard(0, 2)
    assert r.lengths[0] == 3
    with pytest.raises(ValueError, match="can discard 0 .. 0"):
        r.discard(0, 1)
