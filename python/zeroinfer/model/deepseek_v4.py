"""The DeepSeek-V4 graph: embed -> N-stream residual through decoder layers (mHC around
attention and MoE) -> hyper-head collapse -> norm -> untied head. Parameter names follow HF's
module tree (model.layers.N.self_attn.q_a_proj.weight, ...), except the packed MXFP4 experts.
The graph knows nothing of scheduling: it reads a ForwardBatch and the caller's caches."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from zeroinfer.model.attention import Attention, NormWeight
from zeroinfer.model.cache import ForwardBatch, LayerCache
from zeroinfer.model.config import ModelConfig
from zeroinfer.model.linear import Linear
from zeroinfer.model.mhc import HyperConnection, HyperHead
from zeroinfer.model.moe import MoE
from zeroinfer.model.norm import rms_norm
from zeroinfer.model.rope import RopeTables

if TYPE_CHECKING:
    from zeroinfer.parallel import ExpertParallel


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype,
                 ep: ExpertParallel | None = None) -> None:
        super().__init__()
        c = config
        hc = dict(hc_mult=c.hc_mult, hidden=c.hidden_size, iters=c.hc_sinkhorn_iters,
                  eps=c.hc_eps, norm_eps=c.rms_norm_eps)
        self.eps = c.rms_norm_eps
        self.attn_hc = HyperConnection(**hc)
        self.ffn_hc = HyperConnection(**hc)
        self.input_layernorm = NormWeight(c.hidden_size)
        self.post_attention_layernorm = NormWeight(c.hidden_size)
        self.self_attn = Attention(c, layer, dtype)
        self.mlp = MoE(c, layer, dtype, ep)

    def forward(self, streams, batch: ForwardBatch, cache: LayerCache, rope: RopeTables):
        post, comb, x = self.attn_hc.weights(streams)
        a = self.self_attn(rms_norm(x, self.input_layernorm.weight, self.eps), batch, cache, rope)
        streams = HyperConnection.mix(streams, a, post, comb)
        post, comb, x = self.ffn_hc.weights(streams)
        f = self.mlp(rms_norm(x, self.post_attention_layernorm.weight, self.eps), batch.input_ids,
                     batch.positions)
        return HyperConnection.mix(streams, f, post, comb)


class DeepseekV4Model(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 ep: ExpertParallel | None = None) -> None:
        super().__init__()
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(c, i, dtype, ep)
                                    for i in range(c.num_hidden_layers))
        self.norm = NormWeight(c.hidden_size)
        self.hc_head = HyperHead(c.hc_mult, c.hidden_size, c.hc_eps, c.rms_norm_eps)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 ep: ExpertParallel | None = None) -> None:
        """ep: this rank's part in expert parallelism (zeroinfer.parallel); the routed experts
        are then its slots, and every forward is a collective of the group."""
        super().__init__()
        self.config, self.dtype, self.ep = config, dtype, ep
        self.model = DeepseekV4Model(config, dtype, ep)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype)
        self._rope: RopeTables | None = None

    def rope(self, device: torch.device) -> RopeTables:
        if self._rope is None or self._rope.main.device != device:
            self._rope = RopeTables(self.config, device)
        return self._rope

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: list[LayerCache],
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [T, V] (or only for the token rows `logits_rows`), float32."""
        m, c = self.model, self.config
        x = m.embed_tokens(batch.input_ids)
        streams = x.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()
        rope = self.rope(x.device)
        for layer, cache in zip(m.layers, caches):
            streams = layer(streams, batch, cache, rope)
        if logits_rows is not None:
            streams = streams[logits_rows]
        h = rms_norm(m.hc_head(streams), m.norm.weight, c.rms_norm_eps)
        return self.lm_head(h).float()

    @torch.inference_mode()
    def idle_forward(self) -> None:
        """Expert parallelism: serve the other ranks' tokens in every MoE layer with none of
        this rank's own (what a rank with nothing scheduled runs while the others step)."""
        if self.ep is None:
            raise RuntimeError("idle_forward: the model has no expert parallelism")
        c, dev = self.config, self.lm_head.weight.device
        k = c.num_experts_per_tok
        y = torch.empty(0, c.hidden_size, dtype=self.dtype, device=dev)
        ids = torch.empty(0, k, dtype=torch.int32, device=dev)
        w = torch.empty(0, k, dtype=torch.float32, device=dev)
        keys = torch.empty(0, dtype=torch.int64, device=dev)
        for layer in self.model.layers:
            layer.mlp.routed(y, ids, w, keys)

    def rebalance_experts(self) -> bool:
        """Expert parallelism: rebalance the routed experts over the group from the counted load
        (ExpertParallel.rebalance; a collective). Returns whether any expert moved."""
        if self.ep is None:
            raise RuntimeError("rebalance_experts: the model has no expert parallelism")
        return self.ep.rebalance([layer.mlp.experts.buffers_of_slots()
                                  for layer in self.model.layers])
