#include "registry.h"
namespace zi::bindings {
void register_dispatch_combine(pybind11::module_&) {}
}
