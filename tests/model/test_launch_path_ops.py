"""The model's forward makes no op that would stall the host on CUDA, checked on the CPU.

On a GPU the engine launches rounds under torch's sync guard (tests/engine/test_engine_cuda.py),
but a CPU-only CI never sees such an op: session 39's pooling wrote a Python scalar by an indexed
write, a host-to-device copy on CUDA, and only the GPU machine caught it. Here every aten op of a
prefill with closing windows and of decode steps (variable- and fixed-shape) is inspected:
  * an indexed write (index_put_) of a 0-dim value: on CUDA a host-to-device copy;
  * an index by a boolean mask, nonzero, masked_select: on CUDA a sync for the result's size.
(The ops' own CPU-only value checks read values with .item(); on CUDA they are skipped, so
.item() is not flagged.)"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zeroinfer.model import load

SIZE_SYNCS = ("aten.nonzero", "aten.masked_select", "aten._local_scalar_dense")


class FlagHostStalls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.flagged: list[str] = []

    def _flag(self, why: str) -> None:
        where = [f for f in traceback.format_stack()[:-2] if "zeroinfer" in f]
        self.flagged.append(why + "\n" + (where[-1] if where else "?"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(SIZE_SYNCS):
            self._flag(name)
        if name.startswith(("aten.index.", "aten.index_put")):
            indices = args[1] if len(args) > 1 else []
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                self._flag(f"{name} by a boolean mask")
            if name.startswith("aten.index_put") and args[2].dim() == 0:
                self._flag(f"{name} of a 0-dim value")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("graphs", [False, True], ids=["variable-shape", "fixed-shape"])
def test_forward_has_no_host_stalling_ops(gen, graphs):
    model = load("dummy:tiny-yarn", seed=int(torch.randint(0, 1000, (1,), generator=gen)))
    runner = model.runner(max_seqs=3, max_len=64, decode_graphs=graphs)
    V = model.config.vocab_size
    prompts = {0: 2, 1: 19, 2: 33}  # a first window still open, several closing at both rates
    feeds = [{s: torch.randint(0, V, (n,), generator=gen).tolist() for s, n in prompts.items()}]
    feeds += [{s: torch.randint(0, V, (1,), generator=gen).tolist() for s in prompts}
              for _ in range(2 * model.config.hca_rate)]
    mode = FlagHostStalls()
    with mode:
        for feed in feeds:
            runner.step(feed)
    assert not mode.flagged, "\n".join(mode.flagged[:5])
