"""The DeepSeek-V4 graph: embed -> N-stream residual through decoder layers (mHC around
attention and MoE) -> hyper-head collapse -> norm -> untied head. Parameter names follow HF's
module tree (model.layers.N.self_attn.q_a_proj.weight, ...), except the packed MXFP4 experts.
The graph knows nothing of scheduling: it reads a ForwardBatch and the caller's caches."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from zeroinfer.model.attention import Attention, NormWeight, dense
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


class MTPLayer(nn.Module):
    """One multi-token-prediction module (DeepSeek's reference `MTPBlock`, native `mtp.{i}.*`):
    at position t it reads the main model's last streams there and the embedding of token t + 1,
    and its logits predict token t + 2. Its block is a V4 decoder layer numbered past the main
    ones (config.layer_kind: sliding-window attention over a cache of its own, a learned
    router); the embedding and the LM head are the main model's.

        x = e_proj(enorm(embed(next_ids))) (to every stream) + h_proj(hnorm(streams))
        x = block(x);  logits = head(norm(hc_head(x)))

    Chained drafting feeds x (the block's output streams) back as the next step's streams."""

    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.eps = c.rms_norm_eps
        self.enorm = NormWeight(c.hidden_size)
        self.hnorm = NormWeight(c.hidden_size)
        self.e_proj = dense(c.hidden_size, c.hidden_size, dtype)
        self.h_proj = dense(c.hidden_size, c.hidden_size, dtype)
        self.block = DecoderLayer(c, c.num_hidden_layers + index, dtype)
        self.hc_head = HyperHead(c.hc_mult, c.hidden_size, c.hc_eps, c.rms_norm_eps)
        self.norm = NormWeight(c.hidden_size)

    def forward(self, streams: torch.Tensor, embedded: torch.Tensor, batch: ForwardBatch,
                cache: LayerCache, rope: RopeTables) -> torch.Tensor:
        """streams [T, N, D] (the main model's last, or this module's from the step before)
        and embedded [T, D] (the next tokens' embeddings) at batch's positions -> the block's
        output streams [T, N, D]."""
        T, N, D = streams.shape
        e = self.e_proj(rms_norm(embedded, self.enorm.weight, self.eps))
        h = self.h_proj(rms_norm(streams.reshape(T * N, D), self.hnorm.weight, self.eps))
        x = h.view(T, N, D) + e.unsqueeze(1)
        return self.block(x, batch, cache, rope)

    def hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """The head's input [T, D]: the streams collapsed, then normed."""
        return rms_norm(self.hc_head(streams), self.norm.weight, self.eps)


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
                 ep: ExpertParallel | None = None, *, mtp: bool = False) -> None:
        """ep: this rank's part in expert parallelism (zeroinfer.parallel); the routed experts
        are then its slots, and every forward is a collective of the group. mtp: build the
        config's multi-token-prediction modules (the drafter of speculative decoding). Under
        ep every rank holds a module whole, all its experts (one more layer's worth of expert
        memory a rank), so that drafting needs no exchange."""
        super().__init__()
        self.config, self.dtype, self.ep = config, dtype, ep
        self.model = DeepseekV4Model(config, dtype, ep)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype)
        # (registered last: the state dict lists the main model's tensors first)
        self.mtp = nn.ModuleList(MTPLayer(config, i, dtype)
                                 for i in range(config.num_nextn_predict_layers if mtp else 0))
        self._rope: RopeTables | None = None

    def rope(self, device: torch.device) -> RopeTables:
        if self._rope is None or self._rope.main.device != device:
            self._rope = RopeTables(self.config, device)
        return self._rope

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: list[LayerCache],
                logits_rows: torch.Tensor | None = None, *, streams_out: list | None = None
                ) -> torch.Tensor:
        """Logits [T, V] (or only for the token rows `logits_rows`), float32. caches: one a
        main layer (any after them, the MTP modules', are not read here). streams_out: a list
        the last layer's streams [T, N, D] of every token are appended to (the MTP modules'
        input)."""
        m, c = self.model, self.config
        x = m.embed_tokens(batch.input_ids)
        streams = x.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()
        rope = self.rope(x.device)
        for layer, cache in zip(m.layers, caches):
            streams = layer(streams, batch, cache, rope)
        if streams_out is not None:
            streams_out.append(streams)
        if logits_rows is not None:
            streams = streams[logits_rows]
        h = rms_norm(m.hc_head(streams), m.norm.weight, c.rms_norm_eps)
        return self.lm_head(h).float()

    @torch.inference_mode()
    def mtp_forward(self, streams: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch,
                    cache: LayerCache, logits_rows: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first MTP module over batch's tokens: streams [T, N, D] at batch's positions
        (the main model's last, or the module's own from a chained step), next_ids [T] the
        tokens one position on; cache: the module's. Returns (logits [T, V] float32 - or of the
        rows `logits_rows` - predicting two positions on, the output streams [T, N, D])."""
        if not len(self.mtp):
            raise RuntimeError("mtp_forward: the model was built without its MTP modules")
        mtp = self.mtp[0]
        out = mtp(streams, self.model.embed_tokens(next_ids), batch, cache,
                  self.rope(streams.device))
        rows = out if logits_rows is None else out[logits_rows]
        return self.lm_head(mtp.hidden(rows)).float(), out

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
