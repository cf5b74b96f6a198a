"""Test set-up shared by every test module.

* `gpu`-marked tests skip cleanly unless zeroinfer._C has CUDA kernels and a CUDA device is usable.
* `gen` gives each test a torch.Generator with a FRESH seed every run (inputs are never fixed),
  printed so a failure can be replayed with ZEROINFER_TEST_SEED=<seed>.
"""

from __future__ import annotations

import os
import secrets

import pytest
import torch


def gpu_usable() -> bool:
    from zeroinfer import _C

    return bool(_C.WITH_CUDA) and _C.cuda_device_count() > 0 and torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if gpu_usable():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of zeroinfer._C")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed(request) -> int:
    # (set and empty, as a script that passes a seed through may leave it, draws a fresh one)
    s = int(os.environ.get("ZEROINFER_TEST_SEED") or secrets.randbits(31))
    print(f"[{request.node.nodeid}] ZEROINFER_TEST_SEED={s}")
    return s


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def single_torch_thread():
    """torch's own intra-op threads only slow small reference computations down on a shared
    2-core machine (they spin against the kernel's pool); the kernel keeps its threads. Test
    modules opt in with pytestmark = pytest.mark.usefixtures("single_torch_thread")."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=[None, 16], ids=["threads-default", "threads-16"])
def torch_threads(request):
    """The test at the machine's thread count and again at 16 threads (the GPU machines' hosts):
    torch splits some CPU kernels by shape and thread count, and the last bits can follow (the
    compressors' softmax over an inner dim did: exact on CI's 2 cores, not on 16). Tests of
    bitwise invariance take it."""
    n = torch.get_num_threads()
    if request.param is not None:
        torch.set_num_threads(request.param)
    yield
    torch.set_num_threads(n)
