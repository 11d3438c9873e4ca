// The default backend: CUDA when built with it and a GPU is present, else the
// simulated device. See include/ccalloc/backend/default_backend.hpp.
#include <ccalloc/backend/default_backend.hpp>
#include <ccalloc/backend/sim_backend.hpp>

#ifndef CCALLOC_HAVE_CUDA_BACKEND  // set by CMake (CCALLOC_WITH_CUDA)
#define CCALLOC_HAVE_CUDA_BACKEND 0
#endif
#if CCALLOC_HAVE_CUDA_BACKEND
#include <ccalloc/backend/cuda_backend.hpp>
#endif

namespace ccalloc {

bool built_with_cuda() noexcept { return CCALLOC_HAVE_CUDA_BACKEND != 0; }

std::shared_ptr<device_backend> make_default_backend() {
#if CCALLOC_HAVE_CUDA_BACKEND
  if (cuda_backend::available_device_count() > 0) return std::make_shared<cuda_backend>();
#endif
  return std::make_shared<sim_backend>();
}

}  // namespace ccalloc
