"""zeroinfer.ops: one public function per kernel family.

Every op validates all of its arguments (raising TypeError/ValueError that name the argument),
then runs the C++ CPU twin for CPU tensors or the CUDA kernel for CUDA tensors. Each has a
float64 pure-torch reference, `<name>_ref`, which the tests use as the oracle.
"""

from zeroinfer.ops.dispatch_combine import MoeDispatch, moe_combine, moe_dispatch
from zeroinfer.ops.indexer import indexer_scores
from zeroinfer.ops.length_correction import CorrectedLengths, correct_lengths
from zeroinfer.ops.mhc import MHC_MAX_STREAMS, MhcMixes, mhc_collapse, mhc_mix, mhc_mixes
from zeroinfer.ops.moe_gemm import (MXFP4_ROUTED_MAX_ROWS, Mxfp4PackedWeights,
                                     mxfp4_act_scale_mn_major, mxfp4_grouped_gemm, mxfp4_prepack,
                                     mxfp4_unpack)
from zeroinfer.ops.moe_route import MOE_ROUTE_MAX_EXPERTS, MOE_ROUTE_MAX_TOPK, moe_route
from zeroinfer.ops.rms_norm import rms_norm
from zeroinfer.ops.rope import rope_rotate
from zeroinfer.ops.sparse_mla import sparse_mla_attention
from zeroinfer.reference.dispatch_combine import moe_combine_ref, moe_dispatch_ref
from zeroinfer.reference.indexer import indexer_scores_ref
from zeroinfer.reference.length_correction import correct_lengths_ref
from zeroinfer.reference.mhc import mhc_collapse_ref, mhc_mix_ref, mhc_mixes_ref
from zeroinfer.reference.moe_gemm import mxfp4_grouped_gemm_ref
from zeroinfer.reference.moe_route import moe_route_ref
from zeroinfer.reference.rms_norm import rms_norm_ref
from zeroinfer.reference.rope import rope_rotate_ref
from zeroinfer.reference.sparse_mla import sparse_mla_attention_ref

__all__ = [
    "MHC_MAX_STREAMS",
    "MOE_ROUTE_MAX_EXPERTS",
    "MOE_ROUTE_MAX_TOPK",
    "MXFP4_ROUTED_MAX_ROWS",
    "CorrectedLengths",
    "MhcMixes",
    "MoeDispatch",
    "Mxfp4PackedWeights",
    "correct_lengths",
    "correct_lengths_ref",
    "indexer_scores",
    "indexer_scores_ref",
    "mhc_collapse",
    "mhc_collapse_ref",
    "mhc_mix",
    "mhc_mix_ref",
    "mhc_mixes",
    "mhc_mixes_ref",
    "moe_combine",
    "moe_combine_ref",
    "moe_dispatch",
    "moe_dispatch_ref",
    "moe_route",
    "moe_route_ref",
    "mxfp4_act_scale_mn_major",
    "mxfp4_grouped_gemm",
    "mxfp4_grouped_gemm_ref",
    "mxfp4_prepack",
    "mxfp4_unpack",
    "rms_norm",
    "rms_norm_ref",
    "rope_rotate",
    "rope_rotate_ref",
    "sparse_mla_attention",
    "sparse_mla_attention_ref",
]
