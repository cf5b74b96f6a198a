#include "registry.h"
#include "zeroinfer/indexer.h"

namespace py = pybind11;

namespace zi::bindings {

void register_indexer(py::module_& m) {
  def(m, "indexer_scores",
      [](bool cuda, int64_t num_tokens, int64_t heads, int64_t dim, int64_t num_entries,
         int64_t num_seqs, int64_t table_stride, int64_t block_size, int key_dtype, bool index64,
         float scale, uintptr_t q, uintptr_t weights, uintptr_t keys, uintptr_t table,
         uintptr_t seq, uintptr_t visible, uintptr_t out, uintptr_t stream) {
        IndexerScoresParams p{num_tokens, heads, dim, num_entries, num_seqs, table_stride,
                              block_size, static_cast<DType>(key_dtype), index64, scale,
                              as_ptr<const float>(q), as_ptr<const float>(weights),
                              as_ptr<const void>(keys), as_ptr<const int32_t>(table),
                              as_ptr<const void>(seq), as_ptr<const void>(visible),
                              as_ptr<float>(out)};
        py::gil_scoped_release nogil;
        if (!cuda) {
          indexer_scores_cpu(p);
          return;
        }
#ifdef ZEROINFER_WITH_CUDA
        indexer_scores_cuda(p, as_ptr<void>(stream));
#else
        (void)stream;
        throw std::runtime_error("zeroinfer._C was built without CUDA");
#endif
      });
}

}  // namespace zi::bindings
