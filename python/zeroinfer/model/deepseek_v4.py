"""The DeepSeek-V4 graph: embed -> N-stream residual through decoder layers (mHC around
attention and MoE) -> hyper-head collapse -> norm -> untied head. Parameter names follow HF's
module tree (model.layers.N.self_attn.q_a_proj.weight, ...), except the packed MXFP4 experts.
The graph knows nothing of scheduling: it reads a ForwardBatch and the caller's caches."""

from __future__ import annotations

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


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
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
        self.mlp = MoE(c, layer, dtype)

    def forward(self, streams, batch: ForwardBatch, cache: LayerCache, rope: RopeTables):
        post, comb, x = self.attn_hc.weights(streams)
        a = self.self_attn(rms_norm(x, self.input_layernorm.weight, self.eps), batch, cache, rope)
        streams = HyperConnection.mix(streams, a, post, comb)
        post, comb, x = self.ffn_hc.weights(streams)
        f = self.mlp(rms_norm(x, self.post_attention_layernorm.weight, self.eps), batch.input_ids)
        return HyperConnection.mix(streams, f, post, comb)


class DeepseekV4Model(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(c, i, dtype) for i in range(c.num_hidden_layers))
        self.norm = NormWeight(c.hidden_size)
        self.hc_head = HyperHead(c.hc_mult, c.hidden_size, c.hc_eps, c.rms_norm_eps)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        self.model = DeepseekV4Model(config, dtype)
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
