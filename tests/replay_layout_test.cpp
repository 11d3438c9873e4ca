// The replay's layout is the same in every process: the simulated device's
// segment addresses are its own (sim_backend.hpp, "Addresses"), so neither
// address-space randomization nor a second thread's malloc arena can turn a
// best-fit tie the other way.
//
// The parent test runs this program again N times (each a fresh process, so
// a fresh randomized address space), each child replaying every trace with
// two threads at once (each thread its own replays: their host allocations,
// malloc arenas and mappings interleave), and printing one digest per trace
// and configuration: the replay's figures, each pass's, and the layout (each
// segment's offset from the lowest plain segment, its blocks' offsets, sizes
// and states) every 1,024 events and at the end. Every child must print the
// same digests.
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/snapshot.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>
#include <ccalloc/replay/replay.hpp>
#include <ccalloc/replay/trace.hpp>

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;

const fs::path bundled_dir = fs::path(CCALLOC_SOURCE_DIR) / "data" / "traces";
const fs::path shared_dir = fs::path(CCALLOC_SHARED_TRACES_DIR);
constexpr const char* child_env = "CCALLOC_LAYOUT_CHILD_TRACES";

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr int runs = 3;  // sanitizers make each child several times slower
#else
constexpr int runs = 20;
#endif

struct fnv {
  std::uint64_t h = 1469598103934665603ull;
  void add(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  void add(const std::string& s) {
    for (const char c : s) {
      h ^= static_cast<unsigned char>(c);
      h *= 1099511628211ull;
    }
    add(s.size());
  }
};

// The layout, independent of where the host put the simulated device's
// range: plain segments by their offset from the lowest plain segment;
// expandable segments (host reservations, which the allocator orders by
// creation) by their contents alone, sorted.
void add_layout(fnv& f, const ccalloc::memory_snapshot& s) {
  std::uintptr_t lowest = UINTPTR_MAX;
  for (const auto& seg : s.segments)
    if (!seg.is_expandable) lowest = std::min(lowest, seg.address);
  std::vector<std::string> expandable;
  for (const auto& seg : s.segments) {
    std::string text = std::to_string(seg.stream) + (seg.is_small_pool ? "s" : "l") + std::to_string(seg.total_bytes) +
                       "/" + std::to_string(seg.mapped_bytes) + ":";
    for (const auto& b : seg.blocks)
      text += std::to_string(b.address - seg.address) + "+" + std::to_string(b.size_bytes) + "." +
              std::to_string(static_cast<int>(b.state)) + (b.mapped ? "" : "u") + ",";
    if (seg.is_expandable) {
      expandable.push_back(std::move(text));
    } else {
      f.add(seg.address - lowest);
      f.add(text);
    }
  }
  std::sort(expandable.begin(), expandable.end());
  for (const auto& text : expandable) f.add(text);
}

std::string digest(const fs::path& file, const std::string& config) {
  const ccalloc::trace t = ccalloc::read_trace_file(file.string());
  ccalloc::replay_options o;
  o.config = config;
  fnv f;
  o.after_event = [&](std::size_t index, ccalloc::caching_allocator& a) {
    if (index % 1024 == 1023 || index + 1 == t.events.size()) add_layout(f, a.snapshot(false));
    return true;
  };
  const ccalloc::replay_result r = ccalloc::replay_trace(t, o);
  for (const std::uint64_t v :
       {r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes, r.device_mallocs, r.device_frees,
        r.ooms, r.alloc_retries, r.device_synchronizations, r.pages_remapped, r.pages_mapped, r.pages_unmapped,
        r.bytes_moved_between_streams, r.stream_waits, r.thread_cache_hits, std::uint64_t{r.recorded_addresses}})
    f.add(v);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(f.h));
  return file.stem().stem().string() + (config.empty() ? " default " : " pytorch ") + hex;
}

// The traces of `dir` (and its fidelity/ folder) named in native_peaks.json
// or found there.
std::vector<fs::path> traces_of(const fs::path& dir) {
  std::vector<fs::path> out;
  for (const fs::path& d : {dir, dir / "fidelity"}) {
    if (!fs::is_directory(d)) continue;
    for (const auto& e : fs::directory_iterator(d))
      if (e.path().string().ends_with(".trace.gz")) out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Runs this program `runs` times as a child over `dir`'s traces; each must
// print the same digests, one per trace and configuration.
void expect_same_in_every_process(const fs::path& dir) {
  const std::vector<fs::path> traces = traces_of(dir);
  ASSERT_FALSE(traces.empty()) << dir;
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  const std::string command = std::string(child_env) + "='" + dir.string() + "' '" + self +
                              "' --gtest_also_run_disabled_tests --gtest_filter=ReplayLayout.DISABLED_Child 2>&1";
  std::vector<std::string> first;
  for (int run = 0; run < runs; ++run) {
    SCOPED_TRACE("run " + std::to_string(run));
    FILE* pipe = ::popen(command.c_str(), "r");
    ASSERT_NE(pipe, nullptr);
    std::vector<std::string> lines;
    std::string all;
    std::array<char, 512> buf{};
    while (std::fgets(buf.data(), buf.size(), pipe)) {
      const std::string line = buf.data();
      all += line;
      if (line.starts_with("layout ")) lines.push_back(line);
    }
    ASSERT_EQ(::pclose(pipe), 0) << all;
    ASSERT_EQ(lines.size(), 2 * traces.size()) << all;
    if (run == 0) first = lines;
    else EXPECT_EQ(lines, first);
  }
}

}  // namespace

// The child: two threads replay the traces of $CCALLOC_LAYOUT_CHILD_TRACES
// at once, each with the default configuration and PyTorch's policies.
TEST(ReplayLayout, DISABLED_Child) {
  const char* dir = std::getenv(child_env);
  ASSERT_NE(dir, nullptr) << "run by ReplayLayout.SameInEveryProcess*";
  const std::vector<fs::path> traces = traces_of(dir);
  std::vector<std::pair<fs::path, std::string>> jobs;
  for (const auto& t : traces)
    for (const char* config : {"", ccalloc::pytorch_policies}) jobs.emplace_back(t, config);
  std::vector<std::string> out(jobs.size());
  const auto work = [&](std::size_t first) {
    for (std::size_t i = first; i < jobs.size(); i += 2) out[i] = digest(jobs[i].first, jobs[i].second);
  };
  std::thread other(work, 1);
  work(0);
  other.join();
  for (const auto& line : out) std::printf("layout %s\n", line.c_str());
}

TEST(ReplayLayout, BundledTracesReplayTheSameInEveryProcessWithTwoThreads) {
  expect_same_in_every_process(bundled_dir);
}

TEST(ReplayLayout, SharedTracesReplayTheSameInEveryProcessWithTwoThreads) {
  if (!fs::exists(shared_dir / "native_peaks.json")) GTEST_SKIP() << "no " << shared_dir;
  expect_same_in_every_process(shared_dir);
}
