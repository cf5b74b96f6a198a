"""The package itself: the extension imports anywhere and reports its backends honestly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import zeroinfer
from zeroinfer import _C


def test_build_info_reports_backends():
    info = zeroinfer.build_info()
    assert info["version"] == zeroinfer.__version__ == _C.VERSION
    assert info["cpu"] is True and info["cpu_threads"] >= 1
    assert info["cuda"] == bool(_C.WITH_CUDA)
    assert info["ascend"] is False and "CANN" in info["ascend_reason"]
    assert info["gpu_usable"] == bool(info["cuda_devices"])
    if not info["cuda"]:
        assert info["cuda_devices"] == [] and info["cuda_archs"] == ""


@pytest.mark.skipif(os.environ.get("ZEROINFER_EXPECT_CUDA") != "1",
                    reason="set ZEROINFER_EXPECT_CUDA=1 where nvcc was present at build time")
def test_cuda_kernels_were_compiled():
    """CI sets ZEROINFER_EXPECT_CUDA=1 when nvcc exists, so a build that silently dropped the
    CUDA sources fails here instead of passing as CPU-only."""
    assert _C.WITH_CUDA and "90a" in _C.CUDA_ARCHS


def test_thread_count_follows_environment():
    code = "from zeroinfer import _C; print(_C.num_threads())"
    env = {**os.environ, "ZEROINFER_NUM_THREADS": "3"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "3"


def test_import_without_gpu_does_not_touch_cuda():
    """_C links the CUDA runtime statically: importing it on a machine without a driver works
    and reports zero devices instead of failing."""
    code = "from zeroinfer import _C; print(_C.cuda_device_count())"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "0"
