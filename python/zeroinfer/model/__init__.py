"""zeroinfer.model: the DeepSeek-V4 graph, its paged caches, the checkpoint loader and the tiny
dummy models. `load` is the public entry point."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zeroinfer.model.config import ModelConfig
from zeroinfer.model.deepseek_v4 import DeepseekV4ForCausalLM
from zeroinfer.model.runner import Model, PagedRunner

if TYPE_CHECKING:
    from zeroinfer.parallel import ExpertParallel

DUMMY_PREFIX = "dummy"


def load(model: str | Path, *, dtype: torch.dtype = torch.float32,
         device: torch.device | str = "cpu", seed: int = 0,
         ep: ExpertParallel | None = None, mtp: bool = False) -> Model:
    """Load a checkpoint directory (config.json + safetensors) or a dummy model.

    `model` is a path, or "dummy" / "dummy:<name>" (names in zeroinfer.model.dummy.DUMMY_CONFIGS;
    plain "dummy" is "dummy:tiny") whose weights are made on the fly from `seed`.
    ep: this rank's part in expert parallelism (zeroinfer.parallel.ExpertParallel, made for
    this model's layer and expert counts): only its slots' routed experts are kept.
    mtp: also load the multi-token-prediction modules (`mtp.*`, speculative decoding's drafter;
    the checkpoint must have config.num_nextn_predict_layers of them); skipped otherwise.
    """
    if dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"load: dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    device = torch.device(device)
    name = str(model)
    config = model_config(name)
    if ep is not None and ep.device != device:
        raise ValueError(f"load: the ExpertParallel is on {ep.device}, the model on {device}")
    if mtp and not config.num_nextn_predict_layers:
        raise ValueError(f"load: {name} has no MTP modules (config num_nextn_predict_layers "
                         f"is 0); the MTP drafter needs them")
    if _is_dummy(name):
        from zeroinfer.model.dummy import random_state_dict

        tensors = iter(random_state_dict(config, seed, mtp=mtp).items())
        if ep is not None:  # made whole (from the seed), then cut to this rank's slots
            from zeroinfer.parallel import local_expert_tensors

            tensors = local_expert_tensors(tensors, config, ep)
    else:
        from zeroinfer.model.weights import iter_checkpoint

        # An EP rank reads only its own slots' routed experts from the files.
        tensors = iter_checkpoint(name, config, mtp=mtp,
                                  experts=None if ep is None else _local_experts(ep, config))
    with torch.device("meta"):
        net = DeepseekV4ForCausalLM(config, dtype, ep, mtp=mtp)
    net = net.to_empty(device=device)
    fill_parameters(net, tensors, source=name)
    if device.type == "cuda":  # repack the MXFP4 experts for the CUDA kernel once, at load
        from zeroinfer.model.moe import Experts

        for mod in net.modules():
            if isinstance(mod, Experts):
                mod.packed()
    net.eval()
    return Model(net, device)


def _local_experts(ep: ExpertParallel, config: ModelConfig):
    from zeroinfer.parallel import check_placement

    check_placement(ep.placement, config)
    return ep.local_experts()


def _is_dummy(name: str) -> bool:
    return name == DUMMY_PREFIX or name.startswith(DUMMY_PREFIX + ":")


def model_config(model: str | Path) -> ModelConfig:
    """The configuration `load(model)` builds (a checkpoint's config.json or a dummy's), without
    the weights: what an expert-parallel placement is sized from before loading."""
    name = str(model)
    if _is_dummy(name):
        from zeroinfer.model.dummy import dummy_config

        return dummy_config(name.partition(":")[2] or "tiny")
    return ModelConfig.from_pretrained(name)


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


__all__ = ["DeepseekV4ForCausalLM", "Model", "ModelConfig", "PagedRunner", "load",
           "model_config"]
