"""zeroinfer: a kernel-first inference engine for DeepSeek-V4-class mixture-of-experts models."""

from __future__ import annotations

__version__ = "0.1.0"


def build_info() -> dict[str, object]:
    """Which backends zeroinfer._C was compiled with, and which GPU (if any) it can use.

    Keys: version, cpu (always True), cpu_threads, cuda (CUDA kernels compiled), cuda_archs,
    cuda_devices (list of descriptions of usable devices; empty without a driver or GPU),
    gpu_usable, ascend (AscendC kernels compiled; False wherever CANN is absent) and
    ascend_reason.
    """
    from zeroinfer import _C

    devices: list[str] = []
    if _C.WITH_CUDA:
        devices = [_C.cuda_device_description(i) for i in range(_C.cuda_device_count())]
    return {
        "version": _C.VERSION,
        "cpu": True,
        "cpu_threads": _C.num_threads(),
        "cuda": bool(_C.WITH_CUDA),
        "cuda_archs": _C.CUDA_ARCHS,
        "cuda_devices": devices,
        "gpu_usable": bool(devices),
        "ascend": bool(_C.WITH_ASCEND),
        "ascend_reason": "no AscendC kernels are built: the CANN toolkit (bisheng) is required "
        "and none was found at build time; see ascend/README.md",
    }


def __getattr__(name: str):
    # LLM / SamplingParams are imported on first use so `import zeroinfer` (and build_info)
    # stays cheap and never pulls the engine in.
    if name == "LLM":
        from zeroinfer.llm import LLM

        return LLM
    if name == "RequestOutput":
        from zeroinfer.llm import RequestOutput

        return RequestOutput
    if name == "SamplingParams":
        from zeroinfer.sampling_params import SamplingParams

        return SamplingParams
    if name == "SpeculativeConfig":
        from zeroinfer.engine.speculative import SpeculativeConfig

        return SpeculativeConfig
    if name == "StructuredOutput":
        from zeroinfer.structured_output import StructuredOutput

        return StructuredOutput
    raise AttributeError(f"module 'zeroinfer' has no attribute {name!r}")


__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpeculativeConfig", "StructuredOutput",
           "__version__", "build_info"]
