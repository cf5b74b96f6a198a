#include "registry.h"
namespace zi::bindings {
void register_sparse_mla(pybind11::module_&) {}
}
