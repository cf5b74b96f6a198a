// _C.sparse_mla_attention_cpu: pointers, sizes, strides and dtype codes in; the Python op
// (zeroinfer.ops.sparse_mla) has validated them. The GIL is released while the kernel runs.
#include <pybind11/pybind11.h>

#include "registry.h"
#include "zeroinfer/sparse_mla.h"

namespace py = pybind11;

namespace zi::bindings {
namespace {

SparseMlaCache make_cache(uintptr_t data, int dtype, int64_t num_blocks, int64_t block_size,
                          int64_t block_stride_bytes, uintptr_t indices, int64_t topk,
                          int64_t indices_stride) {
  SparseMlaCache c;
  c.data = as_ptr<const void>(data);
  c.dtype = static_cast<DType>(dtype);
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.block_stride_bytes = block_stride_bytes;
  c.indices = as_ptr<const int32_t>(indices);
  c.topk = topk;
  c.indices_stride = indices_stride;
  return c;
}

}  // namespace

// The argument list shared by the CPU and CUDA entry points (keyword names = Python names).
#define ZI_SPARSE_MLA_ARGS                                                                       \
  uintptr_t q, int q_dtype, int64_t num_tokens, int64_t num_heads, int64_t q_stride_token,       \
      int64_t q_stride_head, uintptr_t kv, int kv_dtype, int64_t kv_num_blocks,                  \
      int64_t kv_block_size, int64_t kv_block_stride_bytes, uintptr_t indices, int64_t topk,     \
      int64_t indices_stride, uintptr_t extra_kv, int extra_kv_dtype, int64_t extra_num_blocks,  \
      int64_t extra_block_size, int64_t extra_block_stride_bytes, uintptr_t extra_indices,       \
      int64_t extra_topk, int64_t extra_indices_stride, uintptr_t attn_sink,                     \
      double softmax_scale, uintptr_t out, int64_t out_stride_token, int64_t out_stride_head,    \
      uintptr_t lse, int64_t lse_stride_token

#define ZI_SPARSE_MLA_PARAMS                                                                      \
  make_params(q, q_dtype, num_tokens, num_heads, q_stride_token, q_stride_head, kv, kv_dtype,     \
              kv_num_blocks, kv_block_size, kv_block_stride_bytes, indices, topk, indices_stride, \
              extra_kv, extra_kv_dtype, extra_num_blocks, extra_block_size,                       \
              extra_block_stride_bytes, extra_indices, extra_topk, extra_indices_stride,          \
              attn_sink, softmax_scale, out, out_stride_token, out_stride_head, lse,              \
              lse_stride_token)

namespace {

SparseMlaParams make_params(ZI_SPARSE_MLA_ARGS) {
  SparseMlaParams p;
  p.q = as_ptr<const void>(q);
  p.q_dtype = static_cast<DType>(q_dtype);
  p.num_tokens = num_tokens;
  p.num_heads = num_heads;
  p.q_stride_token = q_stride_token;
  p.q_stride_head = q_stride_head;
  p.kv = make_cache(kv, kv_dtype, kv_num_blocks, kv_block_size, kv_block_stride_bytes, indices,
                    topk, indices_stride);
  p.has_extra = extra_indices != 0;
  if (p.has_extra)
    p.extra_kv = make_cache(extra_kv, extra_kv_dtype, extra_num_blocks, extra_block_size,
                            extra_block_stride_bytes, extra_indices, extra_topk,
                            extra_indices_stride);
  p.attn_sink = as_ptr<const float>(attn_sink);
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.out = as_ptr<void>(out);
  p.out_stride_token = out_stride_token;
  p.out_stride_head = out_stride_head;
  p.lse = as_ptr<float>(lse);
  p.lse_stride_token = lse_stride_token;
  return p;
}

}  // namespace

#define ZI_SPARSE_MLA_KWARGS                                                                     \
  py::kw_only(), py::arg("q"), py::arg("q_dtype"), py::arg("num_tokens"), py::arg("num_heads"),  \
      py::arg("q_stride_token"), py::arg("q_stride_head"), py::arg("kv"), py::arg("kv_dtype"),   \
      py::arg("kv_num_blocks"), py::arg("kv_block_size"), py::arg("kv_block_stride_bytes"),      \
      py::arg("indices"), py::arg("topk"), py::arg("indices_stride"), py::arg("extra_kv") = 0,   \
      py::arg("extra_kv_dtype") = 0, py::arg("extra_num_blocks") = 0,                            \
      py::arg("extra_block_size") = 0, py::arg("extra_block_stride_bytes") = 0,                  \
      py::arg("extra_indices") = 0, py::arg("extra_topk") = 0,                                   \
      py::arg("extra_indices_stride") = 0, py::arg("attn_sink") = 0, py::arg("softmax_scale"),   \
      py::arg("out"), py::arg("out_stride_token"), py::arg("out_stride_head"), py::arg("lse"),   \
      py::arg("lse_stride_token")

void register_sparse_mla(py::module_& m) {
  def(m,
      "sparse_mla_attention_cpu",
      [](ZI_SPARSE_MLA_ARGS) {
        const SparseMlaParams p = ZI_SPARSE_MLA_PARAMS;
        py::gil_scoped_release release;
        sparse_mla_attention_cpu(p);
      },
      ZI_SPARSE_MLA_KWARGS,
      "Sparse MLA attention on the CPU (raw pointers; use zeroinfer.ops.sparse_mla_attention). "
      "extra_indices = 0 means no extra cache; attn_sink = 0 means no sink.");
#ifdef ZEROINFER_WITH_CUDA
  def(m,
      "sparse_mla_cuda_plan",
      [](int64_t num_tokens, int64_t num_heads, int64_t total_topk, int64_t num_sms, bool fp8,
         int h16) {
        const SparseMlaCudaPlan plan =
            sparse_mla_cuda_plan(num_tokens, num_heads, total_topk, num_sms, fp8, h16);
        return py::make_tuple(plan.num_splits, plan.tiles_per_split, plan.workspace_floats,
                              plan.h16);
      },
      py::arg("num_tokens"), py::arg("num_heads"), py::arg("total_topk"), py::arg("num_sms"),
      py::arg("fp8") = false, py::arg("h16") = -1,
      "(num_splits, tiles_per_split, workspace_floats, h16) of the CUDA sparse MLA kernel; h16: "
      "-1 lets the plan choose the 16-head FP8 kernel and its tile (32 or 64 entries; 0: not "
      "used), 0 / 32 / 64 force the choice");
  def(m,
      "sparse_mla_attention_cuda",
      [](ZI_SPARSE_MLA_ARGS, int64_t num_splits, int64_t tiles_per_split, uintptr_t workspace,
         int h16, uintptr_t stream) {
        const SparseMlaParams p = ZI_SPARSE_MLA_PARAMS;
        SparseMlaCudaPlan plan;
        plan.num_splits = num_splits;
        plan.tiles_per_split = tiles_per_split;
        plan.h16 = h16;
        py::gil_scoped_release release;
        sparse_mla_attention_cuda(p, plan, as_ptr<float>(workspace), as_ptr<void>(stream));
      },
      ZI_SPARSE_MLA_KWARGS, py::arg("num_splits"), py::arg("tiles_per_split"),
      py::arg("workspace"), py::arg("h16"), py::arg("stream"),
      "Sparse MLA attention on a CUDA stream (bf16 q; bf16 or FP8-layout cache); plan from "
      "sparse_mla_cuda_plan.");
#endif
}

}  // namespace zi::bindings
