// _C.mxfp4_grouped_gemm_cpu: pointers (data_ptr() ints, 0 = absent), sizes and zi::DType codes.
// python/zeroinfer/ops/moe_gemm.py validates every argument before calling this.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <stdexcept>

#include "registry.h"
#include "zeroinfer/moe_gemm.h"

namespace py = pybind11;

namespace zi::bindings {
namespace {

// The fields the CPU entry (Mxfp4GemmParams) and the CUDA entry (Mxfp4CudaGemmParams) share.
template <class Params>
void set_common(Params& p, uintptr_t a, int a_dtype, uintptr_t a_scale, uintptr_t expert_offsets,
                uintptr_t expert_counts, uintptr_t masked_m, uintptr_t out, int out_dtype,
                int64_t num_experts, int64_t m_rows, int64_t cap, int64_t n, int64_t k,
                bool fuse_swiglu, const std::optional<double>& swiglu_limit,
                uintptr_t route_ids, int64_t route_div) {
  p.a = as_ptr<const void>(a);
  p.a_dtype = static_cast<DType>(a_dtype);
  p.a_scale = as_ptr<const float>(a_scale);
  p.expert_offsets = as_ptr<const int32_t>(expert_offsets);
  p.expert_counts = as_ptr<const int32_t>(expert_counts);
  p.masked_m = as_ptr<const int32_t>(masked_m);
  p.out = as_ptr<void>(out);
  p.out_dtype = static_cast<DType>(out_dtype);
  p.num_experts = num_experts;
  p.m = m_rows;
  p.cap = cap;
  p.n = n;
  p.k = k;
  p.fuse_swiglu = fuse_swiglu;
  p.has_swiglu_limit = swiglu_limit.has_value();
  p.swiglu_limit = swiglu_limit ? static_cast<float>(*swiglu_limit) : 0.f;
  p.route_ids = as_ptr<const int32_t>(route_ids);
  p.route_div = route_div;
}

}  // namespace

void register_moe_gemm(py::module_& m) {
  def(m,
      "mxfp4_grouped_gemm_cpu",
      [](uintptr_t a, int a_dtype, uintptr_t a_scale, uintptr_t w, uintptr_t w_scale,
         uintptr_t expert_offsets, uintptr_t expert_counts, uintptr_t masked_m, uintptr_t out,
         int out_dtype, int64_t num_experts, int64_t m_rows, int64_t cap, int64_t n, int64_t k,
         bool fuse_swiglu, std::optional<double> swiglu_limit, uintptr_t route_ids,
         int64_t route_div) {
        Mxfp4GemmParams p;
        set_common(p, a, a_dtype, a_scale, expert_offsets, expert_counts, masked_m, out,
                   out_dtype, num_experts, m_rows, cap, n, k, fuse_swiglu, swiglu_limit,
                   route_ids, route_div);
        p.w = as_ptr<const uint8_t>(w);
        p.w_scale = as_ptr<const uint8_t>(w_scale);
        py::gil_scoped_release nogil;
        mxfp4_grouped_gemm_cpu(p);
      },
      "MXFP4 grouped GEMM, CPU twin (see zeroinfer.ops.mxfp4_grouped_gemm; no validation of "
      "tensor sizes here)",
      py::arg("a"), py::arg("a_dtype"), py::arg("a_scale"), py::arg("w"), py::arg("w_scale"),
      py::arg("expert_offsets"), py::arg("expert_counts"), py::arg("masked_m"), py::arg("out"),
      py::arg("out_dtype"), py::arg("num_experts"), py::arg("m"), py::arg("cap"), py::arg("n"),
      py::arg("k"), py::arg("fuse_swiglu"), py::arg("swiglu_limit"), py::arg("route_ids") = 0,
      py::arg("route_div") = 1);
  def(m,
      "mxfp4_grouped_gemm_cuda",
      [](uintptr_t a, int a_dtype, uintptr_t a_scale, uintptr_t w_packed, uintptr_t row_base,
         int64_t n_pad, int64_t k_pad, bool gate_up_interleaved, bool fp8_layout,
         bool wide_scales, uintptr_t expert_offsets,
         uintptr_t expert_counts, uintptr_t masked_m, uintptr_t out, int out_dtype,
         int64_t num_experts, int64_t m_rows, int64_t cap, int64_t n, int64_t k, bool fuse_swiglu,
         std::optional<double> swiglu_limit, int tile, uintptr_t a_kslot,
         int64_t a_scale_row_stride, int64_t a_scale_k_stride, uintptr_t stream,
         uintptr_t route_ids, int64_t route_div, int fp8_tiny_loop) {
#ifdef ZEROINFER_WITH_CUDA
        Mxfp4CudaGemmParams p;
        set_common(p, a, a_dtype, a_scale, expert_offsets, expert_counts, masked_m, out,
                   out_dtype, num_experts, m_rows, cap, n, k, fuse_swiglu, swiglu_limit,
                   route_ids, route_div);
        p.a_scale_row_stride = a_scale_row_stride;
        p.a_scale_k_stride = a_scale_k_stride;
        p.w_packed = as_ptr<const uint8_t>(w_packed);
        p.row_base = as_ptr<const uint8_t>(row_base);
        p.n_pad = n_pad;
        p.k_pad = k_pad;
        p.gate_up_interleaved = gate_up_interleaved;
        p.fp8_layout = fp8_layout;
        p.wide_scales = wide_scales;
        p.tile = tile;
        p.fp8_tiny_loop = fp8_tiny_loop;
        p.a_kslot = as_ptr<const void>(a_kslot);
        py::gil_scoped_release nogil;
        mxfp4_grouped_gemm_cuda(p, as_ptr<void>(stream));
#else
        (void)a, (void)a_dtype, (void)a_scale, (void)w_packed, (void)row_base, (void)n_pad;
        (void)k_pad;
        (void)gate_up_interleaved, (void)fp8_layout, (void)wide_scales, (void)expert_offsets;
        (void)expert_counts;
        (void)masked_m, (void)out, (void)out_dtype, (void)num_experts, (void)m_rows, (void)cap;
        (void)n, (void)k, (void)fuse_swiglu, (void)swiglu_limit, (void)tile, (void)a_kslot;
        (void)a_scale_row_stride, (void)a_scale_k_stride, (void)stream, (void)route_ids;
        (void)route_div, (void)fp8_tiny_loop;
        throw std::runtime_error("zeroinfer._C was built without CUDA");
#endif
      },
      "MXFP4 grouped GEMM, CUDA (packed weights from zeroinfer.ops.mxfp4_prepack; see "
      "zeroinfer.ops.mxfp4_grouped_gemm; no validation of tensor sizes here)",
      py::arg("a"), py::arg("a_dtype"), py::arg("a_scale"), py::arg("w_packed"),
      py::arg("row_base"), py::arg("n_pad"), py::arg("k_pad"), py::arg("gate_up_interleaved"),
      py::arg("fp8_layout"), py::arg("wide_scales"),
      py::arg("expert_offsets"), py::arg("expert_counts"), py::arg("masked_m"), py::arg("out"),
      py::arg("out_dtype"), py::arg("num_experts"), py::arg("m"), py::arg("cap"), py::arg("n"),
      py::arg("k"), py::arg("fuse_swiglu"), py::arg("swiglu_limit"), py::arg("tile"),
      py::arg("a_kslot"), py::arg("a_scale_row_stride"), py::arg("a_scale_k_stride"),
      py::arg("stream"), py::arg("route_ids") = 0, py::arg("route_div") = 1,
      py::arg("fp8_tiny_loop") = 0);
  def(m,
      "mxfp4_cuda_plan",
      [](bool fp8, bool masked, int64_t m_rows, int64_t num_experts, int64_t cap, int requested,
         bool routed) {
        const Mxfp4CudaPlan plan = mxfp4_cuda_plan(fp8, masked, m_rows, num_experts, cap,
                                                   requested, routed);
        py::list launches;
        for (int i = 0; i < plan.launches; ++i)
          launches.append(py::make_tuple(plan.tile[i], plan.from_rows[i]));
        return py::tuple(launches);
      },
      "How the CUDA MXFP4 kernel covers the experts, from the shapes (requested 0) or a forced "
      "tile: a tuple of launches (tile, from_rows), from_rows ascending from 0; a launch runs "
      "the experts holding from_rows up to the next launch's from_rows rows. Tile 4 reads bf16 "
      "activations in the packed weights' k-slot order. routed: the routed layout (topk_ids), "
      "which runs the decode tiles (3, 1) only.",
      py::arg("fp8"), py::arg("masked"), py::arg("m"), py::arg("num_experts"), py::arg("cap"),
      py::arg("requested"), py::arg("routed") = false);
  def(m,
      "mxfp4_fp8_tiny_plain_loop",
      [](int requested) -> bool {
#ifdef ZEROINFER_WITH_CUDA
        return mxfp4_fp8_tiny_plain_loop(requested);
#else
        (void)requested;
        throw std::runtime_error("zeroinfer._C was built without CUDA");
#endif
      },
      "Whether the CUDA float8 tiny tile runs its plain stage loop (3 stages ahead) rather than "
      "the skewed one on the current device; requested 1 / 2 forces plain / skewed, 0 asks the "
      "device (HBM bandwidth per SM).",
      py::arg("requested") = 0);
  m.attr("MXFP4_BLOCK_BYTES") = kMxfp4BlockBytes;
  m.attr("MXFP4_GROUP_STRIPS") = kMxfp4GroupStrips;
  m.attr("MXFP4_STAGE_BLOCKS") = kMxfp4StageBlocks;
  m.attr("MXFP4_PACK_ROWS") = kMxfp4PackRows;
  m.attr("MXFP4_PACK_K") = kMxfp4PackK;
  m.attr("MXFP4_CUDA_MAX_EXPERTS") = kMxfp4CudaMaxExperts;
  m.attr("MXFP4_ROUTED_MAX_ROWS") = kMxfp4RoutedMaxRows;
  m.attr("MXFP4_ROW_BASE_MIN") = kMxfp4RowBaseMin;
  m.attr("MXFP4_ROW_BASE_MAX") = kMxfp4RowBaseMax;
  m.attr("MXFP4_ROW_BASE_SPREAD") = kMxfp4RowBaseSpread;
  m.attr("MXFP4_ROW_BASE_GROUP") = kMxfp4RowBaseGroup;
}

}  // namespace zi::bindings
