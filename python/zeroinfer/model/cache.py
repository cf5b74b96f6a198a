"""Paged caches of the V4 graph and the per-step batch metadata the forward reads.

Every layer keeps a sliding-window KV cache; CSA/HCA layers also keep compressed entries
(CSA: one per `csa_rate` tokens, plus 128-dim indexer keys; HCA: one per `hca_rate` tokens)
and a small per-sequence compressor state: a ring of the raw projections of the sequence's
last positions (CompressorState), enough for the open window, CSA's window before it, and the
tokens a speculative round may write past what is kept.

Paging: each cache kind is a pool of fixed-size blocks. A sequence owns one block table per
kind (`window`, `csa`, `hca`), shared by all layers of that kind — block b of a sequence is
block b in every layer's pool, as in vLLM — plus one compressor-state slot. A token at
absolute position p lives at window slot table_w[p // B] * B + p % B; compressed entry e at
table_c[e // Bc] * Bc + e % Bc. The scheduler owns the tables and may free window blocks that
lie wholly before p - sliding_window; nothing here allocates per step.

Scratch: every pool holds one block past the spec's count and every compressor state one slot
past it (a pool's last block, CompressorState.scratch_slot). They are never handed out: a
fixed-shape decode step (model/decode_graph.py) writes there what a row must not keep - the
entry of a window that did not close, everything of a padding row - so that no write's target
or count depends on the lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroinfer.model.config import CSA, HCA, ModelConfig
from zeroinfer.quant import kv_fp8


@dataclass(frozen=True)
class CacheSpec:
    """Pool sizes. Block sizes count tokens (window) or entries (compressed kinds)."""

    num_window_blocks: int
    num_csa_blocks: int
    num_hca_blocks: int
    num_state_slots: int
    window_block_size: int = 64
    csa_block_size: int = 64
    hca_block_size: int = 8
    kv_fp8: bool = False  # K=V pools (window, compressed entries) in the V4 FP8 layout
    # The most tokens of a round that a later round may take back (rejected speculative
    # drafts: a round of 1 + d tokens keeps at least its first). The compressor rings hold that
    # many positions more, so taking tokens back needs no state rollback (CompressorState).
    max_discard: int = 0


def kv_pool(blocks: int, block_size: int, dim: int, dtype: torch.dtype, device,
            fp8: bool) -> torch.Tensor:
    """A K=V pool of `blocks` blocks: [blocks, block_size, dim] in dtype, or with fp8 uint8
    [blocks, block_size * 584] in the V4 FP8 layout (zeroinfer.quant.kv_fp8; dim must be 512),
    which the attention reads as it is."""
    if not fp8:
        return torch.zeros(blocks, block_size, dim, dtype=dtype, device=device)
    if dim != kv_fp8.HEAD_DIM:
        raise ValueError(f"the FP8 KV layout holds {kv_fp8.HEAD_DIM}-dim vectors (448 NoPE + 64 "
                         f"RoPE), this model's head_dim is {dim}")
    return torch.zeros(blocks, block_size * kv_fp8.BYTES_PER_TOKEN, dtype=torch.uint8,
                       device=device)


def pool_block_size(pool: torch.Tensor) -> int:
    """Slots a block of a pool (either layout) holds."""
    return pool.shape[1] // kv_fp8.BYTES_PER_TOKEN if pool.dtype == torch.uint8 else pool.shape[1]


def write_pool(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """values [n, dim] into pool's flat slots [n] (block * block_size + offset), by indexed
    writes: cast to the pool's dtype, or quantized per token into the FP8 layout (its 576-byte
    row and its 8 scale bytes sit apart in the block)."""
    if pool.dtype != torch.uint8:
        pool.view(-1, pool.shape[-1])[slots] = values.to(pool.dtype)
        return
    q = kv_fp8.quantize_kv_fp8(values.unsqueeze(1)).squeeze(1)  # [n, 584]: row, then scales
    rows, scales = kv_fp8.split_fp8_cache(pool)
    bs = rows.shape[1]
    block, offset = torch.div(slots, bs, rounding_mode="floor"), slots % bs
    rows[block, offset] = q[:, :kv_fp8.ROW_BYTES]
    scales[block, offset] = q[:, kv_fp8.ROW_BYTES:]


class LayerCache:
    """One layer's pools. Tensors are preallocated once; the forward writes into them. Each
    pool's last block is the scratch block (the module doc). The K=V pools (window, comp) are
    in the activation dtype or the V4 FP8 layout (spec.kv_fp8); the indexer's keys and the
    compressor states stay in theirs."""

    def __init__(self, config: ModelConfig, layer: int, spec: CacheSpec, dtype: torch.dtype,
                 device: torch.device) -> None:
        d, kind = config.head_dim, config.layer_kind(layer)
        kw = dict(dtype=dtype, device=device)
        self.kind = kind
        self.window = kv_pool(spec.num_window_blocks + 1, spec.window_block_size, d, dtype, device,
                              spec.kv_fp8)
        self.comp = self.index = None
        self.state: dict[str, CompressorState] = {}
        if kind == CSA:
            self.comp = kv_pool(spec.num_csa_blocks + 1, spec.csa_block_size, d, dtype, device,
                                spec.kv_fp8)
            self.index = torch.zeros(spec.num_csa_blocks + 1, spec.csa_block_size,
                                     config.index_head_dim, **kw)
            self.state["compressor"] = CompressorState(spec.num_state_slots, config.csa_rate, d,
                                                       True, device, spec.max_discard)
            self.state["indexer"] = CompressorState(spec.num_state_slots, config.csa_rate,
                                                    config.index_head_dim, True, device,
                                                    spec.max_discard)
        elif kind == HCA:
            self.comp = kv_pool(spec.num_hca_blocks + 1, spec.hca_block_size, d, dtype, device,
                                spec.kv_fp8)
            self.state["compressor"] = CompressorState(spec.num_state_slots, config.hca_rate, d,
                                                       False, device, spec.max_discard)


class CompressorState:
    """Per-sequence compressor state: a ring of the raw projections (kv, gate: [size, series *
    width] a slot, float32 as HF pools) of the sequence's last `size` positions, position p at
    row p % size. Nothing else is stored: the open window is context_len % rate rows, and CSA's
    Ca half of the window before it is in the ring too, so a fresh sequence needs no reset.

    size = series * rate + max_discard. A round reads positions from the open window's start
    (CSA: the window before it) and writes its own; so that a round whose last tokens are later
    taken back (speculative drafts) leaves the positions that stay needed intact, the ring
    holds max_discard positions more. Then taking tokens back is only a shorter context_len:
    the rejected positions' rows, and any entry of a window they closed, are written again
    (at the same rows and slots) by the round that reaches them. DeepInfer sizes its rings the
    same way (rate + backtrack - 1). One slot past `slots` is the scratch slot (the module
    doc)."""

    def __init__(self, slots: int, rate: int, width: int, overlap: bool, device,
                 max_discard: int = 0) -> None:
        if max_discard < 0:
            raise ValueError(f"max_discard must be >= 0, got {max_discard}")
        series = 2 if overlap else 1
        slots += 1
        self.scratch_slot = slots - 1
        self.rate, self.overlap = rate, overlap
        self.size = series * rate + max_discard
        kw = dict(dtype=torch.float32, device=device)
        self.kv = torch.zeros(slots, self.size, series * width, **kw)
        self.gate = torch.zeros(slots, self.size, series * width, **kw)


def allocate_caches(config: ModelConfig, spec: CacheSpec, dtype: torch.dtype,
                    device: torch.device | str, *, mtp: int = 0) -> list[LayerCache]:
    """One LayerCache a main layer, then one for each of the first `mtp` MTP modules (sliding
    window: their blocks index the same window tables as the main layers')."""
    device = torch.device(device)
    return [LayerCache(config, i, spec, dtype, device)
            for i in range(config.num_hidden_layers + mtp)]


@dataclass
class DecodeRows:
    """A fixed-shape decode step's per-token metadata, on the device. The step has S rows of q
    consecutive positions each (T = S * q, row major; the positions are
    ForwardBatch.positions): one new token a row, or a verification row's sampled token and
    its drafts. state_slots [T] int64: each token's row's state slot; real [T] bool: False for
    a padding row's tokens. A padding row is a fresh sequence with every token at position 0,
    whose every write lands in scratch: its window table row names the window pool's scratch
    block, its other rows -1, its state slot the scratch slot."""

    state_slots: torch.Tensor
    real: torch.Tensor


@dataclass
class ForwardBatch:
    """One step: new tokens of B sequences, flattened in sequence order (no padding).

    input_ids [T] int64, positions [T] int64: absolute positions; sequence i owns tokens
    cu_seqlens[i]:cu_seqlens[i+1] whose positions are context_lens[i] .. context_lens[i]+q_i-1.
    Block tables are int32 [B, max_blocks] (unused entries -1); state_slots [B] int64.
    The CPU copies (lists) drive the per-sequence loops of the compressors.

    decode: a decode step in fixed shapes (DecodeRows: the same number of tokens a row, the
    positions and state slots on the device). Then the host lists are not read: context_lens
    / state_slots may be anything, and every shape follows the rows, the tokens a row and the
    tables' widths alone, so one CUDA graph serves every such step (model/decode_graph.py).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: list[int]
    context_lens: list[int]
    window_tables: torch.Tensor
    csa_tables: torch.Tensor
    hca_tables: torch.Tensor
    state_slots: list[int]
    seq: torch.Tensor | None = None  # [T] sequence index per token; derived if not given
    decode: DecodeRows | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    def seq_of_token(self) -> torch.Tensor:
        """[T] sequence index of every token (computed once per batch, without a host sync)."""
        seq = self.seq if self.seq is not None else self.__dict__.get("_seq")
        if seq is None:
            q = torch.tensor([self.cu_seqlens[i + 1] - self.cu_seqlens[i] for i in range(self.num_seqs)],
                             device=self.positions.device)
            seq = torch.repeat_interleave(torch.arange(self.num_seqs, device=q.device), q,
                                          output_size=self.cu_seqlens[-1])
            self.__dict__["_seq"] = seq
        return seq

    def derived(self, key, make):
        """What `make()` derives from this batch alone, made once a step and shared by every
        layer that asks with the same key (the RoPE tables at the queries' positions, the window
        slots, the entries each query sees): the layers would otherwise each launch the same
        few torch ops."""
        memo = self.__dict__.setdefault("_derived", {})
        if key not in memo:
            memo[key] = make()
        return memo[key]


def host_tensor(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A tensor of host values (a list, or a CPU tensor) on `device`, copied without a host
    synchronisation (a pinned buffer and a non-blocking copy on CUDA), so it can sit inside the
    launch path."""
    t = (values.to(dtype) if isinstance(values, torch.Tensor)
         else torch.tensor(values, dtype=dtype))
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def scratch_slot(pool: torch.Tensor) -> int:
    """The flat slot (block * block_size + offset) of a pool's scratch: its last."""
    return pool.shape[0] * pool_block_size(pool) - 1


def slots_of(tables: torch.Tensor, seq: torch.Tensor, index: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of logical indices `index` (>= 0) of sequences `seq` (same shape)."""
    blocks = tables[seq, torch.div(index, block_size, rounding_mode="floor")].long()
    return blocks * block_size + index % block_size
