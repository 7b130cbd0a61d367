// Apex's plain C++ extension `apex_C` as Apex's DDP uses it (apex/parallel/distributed.py):
// flatten(tensors) -> one flat tensor holding each tensor's values in its logical order;
// unflatten(flat, tensors) -> views of `flat` shaped as `tensors` (the contract of
// torch._utils._flatten_dense_tensors / _unflatten_dense_tensors). Written for this project's
// tests (Apex's csrc is not in the vendored tarball); built by tests/apex_cpu_standins.py.
// ATen and torch's pybind casters only, not <torch/extension.h>: a third less compile time.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

at::Tensor flatten(const std::vector<at::Tensor>& tensors) {
  return at::flatten_dense_tensors(tensors);
}

std::vector<at::Tensor> unflatten(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  return at::unflatten_dense_tensors(flat, tensors);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("flatten", &flatten, "the tensors' values in one flat tensor");
  m.def("unflatten", &unflatten, "views of a flat tensor shaped as the given tensors");
}
