"""The torch-free boundary: turns tensors into what zeroinfer._C takes (pointers, dtype codes,
the stream handle) and says which backend runs a call."""

from __future__ import annotations

import torch

from zeroinfer import _C

# Must match enum class zi::DType in csrc/include/zeroinfer/common.h.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.uint8: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.float8_e4m3fn: 6,
}


def dtype_code(t: torch.Tensor) -> int:
    return DTYPE_CODES[t.dtype]


def ptr(t: torch.Tensor | None) -> int:
    """Data pointer of a tensor, or 0 for an absent optional argument."""
    return 0 if t is None else t.data_ptr()


def stream_of(device: torch.device) -> int:
    """The current CUDA stream's handle on `device`, or 0 for CPU work."""
    if device.type != "cuda":
        return 0
    return torch.cuda.current_stream(device).cuda_stream


def use_cuda(device: torch.device, op: str) -> bool:
    """True if `op` must run on the CUDA backend; raises if that backend was not compiled."""
    if device.type == "cpu":
        return False
    if device.type == "cuda":
        if not _C.WITH_CUDA:
            raise RuntimeError(
                f"{op}: got CUDA tensors but zeroinfer._C was built without CUDA kernels "
                "(no nvcc at build time, or ZEROINFER_CUDA=OFF); rebuild with nvcc available"
            )
        return True
    raise ValueError(f"{op}: tensors must be on 'cpu' or 'cuda', got device {device}")
