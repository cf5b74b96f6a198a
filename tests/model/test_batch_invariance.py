"""Batch invariance, bitwise: a sequence's logits do not depend on which other sequences share
its batch, nor on how its prompt was chunked. The engine's async == sync guarantee rests on it."""

from __future__ import annotations

import pytest
import torch

from zeroinfer import ops
from zeroinfer.model import load


@pytest.mark.usefixtures("torch_threads")
def test_logits_independent_of_batch_and_chunking(gen):
    m = load("dummy:tiny-yarn", seed=11)
    V = m.config.vocab_size
    target = torch.randint(2, V, (45,), generator=gen).tolist()
    others = [torch.randint(2, V, (int(n),), generator=gen).tolist()
              for n in torch.randint(1, 40, (5,), generator=gen)]
    alone = m.logits(target)

    # together with others, in random chunk sizes, with the target at a random batch position
    r = m.runner(max_seqs=6, max_len=64)
    done = [0] * 6
    seqs = others[:2] + [target] + others[2:]
    got = []
    while done[2] < len(target):
        feeds = {}
        for i, s in enumerate(seqs):
            if done[i] < len(s):
                n = int(torch.randint(1, 9, (1,), generator=gen))
                feeds[i] = s[done[i]: done[i] + n]
        out = r.step(feeds)
        for i, toks in feeds.items():
            done[i] += len(toks)
        got.append(out[2])
    assert torch.equal(torch.cat(got), alone)


def test_moe_routed_and_dispatch_paths_agree(gen, monkeypatch):
    """The MoE's two paths, bitwise at the logits: small batches hand the router's ids straight
    to the GEMMs (the routed layout), large ones go through moe_dispatch; the switch point
    (ops.MXFP4_ROUTED_MAX_ROWS) moved to each end."""
    m = load("dummy:tiny", seed=5)
    ids = torch.randint(2, m.config.vocab_size, (30,), generator=gen).tolist()
    monkeypatch.setattr(ops, "MXFP4_ROUTED_MAX_ROWS", 10**9)
    routed = m.logits(ids)
    monkeypatch.setattr(ops, "MXFP4_ROUTED_MAX_ROWS", 0)
    dispatched = m.logits(ids)
    assert torch.isfinite(routed).all()
    assert torch.equal(routed, dispatched)
