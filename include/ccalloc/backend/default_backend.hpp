// ccalloc/backend/default_backend.hpp: the backend a process uses when the
// caller does not choose one.
#pragma once

#include <ccalloc/backend/device_backend.hpp>
#include <memory>

namespace ccalloc {

/// The CUDA backend (ccalloc::cuda_backend) when this build includes it
/// (CMake option CCALLOC_WITH_CUDA) and the CUDA runtime sees at least one
/// device; otherwise a simulated device (ccalloc::sim_backend with its default
/// options: one H200-sized device). Never returns null. Throws backend_error
/// only if a CUDA device is seen but the CUDA backend cannot start on it.
/// Thread safety: may be called concurrently; each call makes a new backend.
[[nodiscard]] std::shared_ptr<device_backend> make_default_backend();

/// Whether this build includes the CUDA backend (CCALLOC_WITH_CUDA).
[[nodiscard]] bool built_with_cuda() noexcept;

}  // namespace ccalloc
