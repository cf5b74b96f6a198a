"""zeroinfer.model: the DeepSeek-V4 graph, its paged caches, the checkpoint loader and the tiny
dummy models. `load` is the public entry point."""

from __future__ import annotations

from pathlib import Path

import torch

from zeroinfer.model.config import ModelConfig
from zeroinfer.model.deepseek_v4 import DeepseekV4ForCausalLM
from zeroinfer.model.runner import Model, PagedRunner

DUMMY_PREFIX = "dummy"


def load(model: str | Path, *, dtype: torch.dtype = torch.float32,
         device: torch.device | str = "cpu", seed: int = 0) -> Model:
    """Load a checkpoint directory (config.json + safetensors) or a dummy model.

    `model` is a path, or "dummy" / "dummy:<name>" (names in zeroinfer.model.dummy.DUMMY_CONFIGS;
    plain "dummy" is "dummy:tiny") whose weights are made on the fly from `seed`.
    """
    if dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"load: dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    device = torch.device(device)
    name = str(model)
    if name == DUMMY_PREFIX or name.startswith(DUMMY_PREFIX + ":"):
        from zeroinfer.model.dummy import dummy_config, random_state_dict

        config = dummy_config(name.partition(":")[2] or "tiny")
        tensors = iter(random_state_dict(config, seed).items())
    else:
        from zeroinfer.model.weights import iter_checkpoint

        config = ModelConfig.from_pretrained(name)
        tensors = iter_checkpoint(name, config)
    with torch.device("meta"):
        net = DeepseekV4ForCausalLM(config, dtype)
    net = net.to_empty(device=device)
    fill_parameters(net, tensors, source=name)
    if device.type == "cuda":  # repack the MXFP4 experts for the CUDA kernel once, at load
        from zeroinfer.model.moe import Experts

        for mod in net.modules():
            if isinstance(mod, Experts):
                mod.packed()
    net.eval()
    return Model(net, device)


def fill_parameters(net: DeepseekV4ForCausalLM, tensors, *, source: str) -> None:
    """Copy (name, tensor) pairs into the graph one at a time (so peak memory stays about one
    copy of the weights), refusing unknown, missing, mis-shaped or wrongly typed tensors."""
    targets = dict(net.state_dict(keep_vars=True))
    seen: set[str] = set()
    for name, t in tensors:
        dst = targets.get(name)
        if dst is None:
            raise ValueError(f"{source}: unexpected tensor {name!r} (not part of the model)")
        if tuple(t.shape) != tuple(dst.shape):
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, "
                             f"expected {tuple(dst.shape)}")
        if t.is_floating_point() != dst.is_floating_point():
            raise TypeError(f"{source}: tensor {name!r} has dtype {t.dtype}, expected "
                            f"{'a floating' if dst.is_floating_point() else 'an integer'} dtype like {dst.dtype}")
        with torch.no_grad():
            dst.copy_(t)
        seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        raise ValueError(f"{source}: missing tensor(s) {missing[:8]}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


__all__ = ["DeepseekV4ForCausalLM", "Model", "ModelConfig", "PagedRunner", "load"]
