// The backend conformance suite (tests/backend_conformance.hpp) on the
// simulated device, in two configurations: the default one (every capability
// on) and one with the optional functions off (granularity below the host
// page size: no virtual memory; no peer access), so both sides of each
// capability are checked. The CUDA backend runs the same cases in
// tests/gpu/gpu_tests.cpp (test "backend_conformance").
#include "backend_conformance.hpp"

#include <ccalloc/backend/sim_backend.hpp>

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <tuple>

namespace {

using namespace ccalloc;

struct skipped {
  std::string why;
};

class sim_fixture final : public conformance::backend_fixture {
 public:
  explicit sim_fixture(sim_options options) : sim_(options) {}
  device_backend& backend() override { return sim_; }
  void keep_busy(stream_t stream) override { sim_.enqueue_work(0, stream, sim_.now() + 1'000'000); }
  void write(void* dst, const std::vector<unsigned char>& bytes) override {
    std::memcpy(dst, bytes.data(), bytes.size());
  }
  std::vector<unsigned char> read(const void* src, std::size_t n) override {
    const auto* p = static_cast<const unsigned char*>(src);
    return {p, p + n};
  }
  void fail(const char* file, int line, const std::string& what) override {
    ADD_FAILURE_AT(file, line) << what;
  }
  [[noreturn]] void skip(const std::string& why) override { throw skipped{why}; }

 private:
  sim_backend sim_;
};

sim_options all_capabilities() {
  sim_options o;
  o.device_count = 2;
  o.capacity_bytes = 256 * mib;
  return o;
}
sim_options no_optional_capabilities() {
  sim_options o;
  o.device_count = 1;
  o.capacity_bytes = 256 * mib;
  o.granularity_bytes = 512;  // below the host page size: no virtual memory
  o.peer_access = false;
  return o;
}

using param = std::tuple<std::size_t /*case index*/, bool /*all capabilities*/>;

class BackendConformance : public ::testing::TestWithParam<param> {};

TEST_P(BackendConformance, Sim) {
  const auto& [index, all] = GetParam();
  sim_fixture f(all ? all_capabilities() : no_optional_capabilities());
  try {
    conformance::all_cases()[index].run(f);
  } catch (const skipped& s) {
    GTEST_SKIP() << s.why;
  }
}

std::string case_name(const ::testing::TestParamInfo<param>& info) {
  return std::string(conformance::all_cases()[std::get<0>(info.param)].name) +
         (std::get<1>(info.param) ? "_all_capabilities" : "_no_optional_capabilities");
}

INSTANTIATE_TEST_SUITE_P(Cases, BackendConformance,
                         ::testing::Combine(::testing::Range(std::size_t{0}, conformance::all_cases().size()),
                                            ::testing::Bool()),
                         case_name);

}  // namespace
