// Replay of real traces on the simulated device (SPEC X8, issue 2's "done when").
//
// The figures compared against come from ../shared/traces/native_peaks.json
// (PyTorch 2.11's allocator on the same programs, recorded on an H200); the
// two traces bundled under data/traces carry their own copy of those figures.
#include <ccalloc/replay/replay.hpp>
#include <ccalloc/replay/trace.hpp>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>

namespace {

namespace fs = std::filesystem;

struct trace_case {
  std::string name;
  fs::path file;
  nlohmann::json native;  // native_peaks.json entry
};

std::vector<trace_case> traces_in(const fs::path& dir) {
  std::vector<trace_case> out;
  std::ifstream in(dir / "native_peaks.json");
  if (!in) return out;
  const nlohmann::json peaks = nlohmann::json::parse(in);
  for (const auto& [name, entry] : peaks.items()) {
    const fs::path file = dir / (name + ".trace.gz");
    if (fs::exists(file)) out.push_back({name, file, entry});
  }
  return out;
}

const fs::path bundled_dir = fs::path(CCALLOC_SOURCE_DIR) / "data" / "traces";
const fs::path shared_dir = fs::path(CCALLOC_SHARED_TRACES_DIR);

ccalloc::replay_result replay(const fs::path& file, const std::string& config = "") {
  ccalloc::replay_options o;
  o.config = config;
  return ccalloc::replay_trace(ccalloc::read_trace_file(file.string()), o);
}

void check_against_native(const std::vector<trace_case>& cases) {
  ASSERT_FALSE(cases.empty());
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto r = replay(c.file);
    // Requested bytes count from alloc until the free completes, as PyTorch's.
    EXPECT_EQ(r.peak_requested_bytes, c.native["requested_peak"].get<std::uint64_t>());
    EXPECT_LE(r.peak_reserved_bytes, c.native["native_reserved_peak"].get<std::uint64_t>());
    EXPECT_EQ(r.events, c.native["events"].get<std::uint64_t>());
    EXPECT_EQ(r.ooms, 0u);
    EXPECT_GE(r.peak_allocated_bytes, r.peak_requested_bytes);
    EXPECT_GE(r.peak_reserved_bytes, r.peak_allocated_bytes);
  }
}

// With trim_on_new_peak off, ccalloc's policies are PyTorch's: the replay must
// reserve exactly what PyTorch reserved, with the same number of cudaMalloc calls.
void check_fidelity(const std::vector<trace_case>& cases) {
  ASSERT_FALSE(cases.empty());
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto r = replay(c.file, "trim_on_new_peak:False");
    EXPECT_EQ(r.peak_reserved_bytes, c.native["native_reserved_peak"].get<std::uint64_t>());
    EXPECT_EQ(r.device_mallocs, c.native["native_device_allocs"].get<std::uint64_t>());
    EXPECT_EQ(r.peak_requested_bytes, c.native["requested_peak"].get<std::uint64_t>());
  }
}

TEST(ReplayTest, BundledTracesReserveNoMoreThanPyTorch) { check_against_native(traces_in(bundled_dir)); }

TEST(ReplayTest, BundledTracesMatchPyTorchExactlyWithItsPolicies) { check_fidelity(traces_in(bundled_dir)); }

TEST(ReplayTest, AllSharedTracesReserveNoMoreThanPyTorch) {
  if (!fs::exists(shared_dir / "native_peaks.json")) GTEST_SKIP() << "no " << shared_dir;
  check_against_native(traces_in(shared_dir));
}

TEST(ReplayTest, AllSharedTracesMatchPyTorchExactlyWithItsPolicies) {
  if (!fs::exists(shared_dir / "native_peaks.json")) GTEST_SKIP() << "no " << shared_dir;
  check_fidelity(traces_in(shared_dir));
}

TEST(ReplayTest, TrimOnNewPeakLowersTheReservationOfTrainingTraces) {
  const auto trimmed = replay(bundled_dir / "gpt2_train.trace.gz");
  const auto pytorch = replay(bundled_dir / "gpt2_train.trace.gz", "trim_on_new_peak:False");
  EXPECT_LT(trimmed.peak_reserved_bytes, pytorch.peak_reserved_bytes);
  EXPECT_GT(trimmed.device_frees, pytorch.device_frees);  // the price: returned segments
}

TEST(ReplayTest, SmallDeviceGivesOutOfMemoryCountsAndKeepsGoing) {
  ccalloc::replay_options o;
  o.device_memory_bytes = std::size_t{256} << 20;  // far below the ~0.5 GB this program needs
  const auto t = ccalloc::read_trace_file((bundled_dir / "bert_copystream_infer.trace.gz").string());
  const auto r = ccalloc::replay_trace(t, o);
  EXPECT_GT(r.ooms, 0u);
  EXPECT_LE(r.peak_reserved_bytes, o.device_memory_bytes);
  EXPECT_EQ(r.events, t.events.size());
}

TEST(ReplayTest, SideStreamGapKeepsRequestedBytesUntilFreeCompleted) {
  // A is freed at line 2 but used on another stream until line 4: its
  // requested bytes still count when B is allocated at line 3 (PyTorch's rule).
  const std::string text =
      "1 alloc 4096 1000 0\n"
      "2 free_requested 4096 1000 0\n"
      "3 alloc 8192 1000 0\n"
      "4 free_completed 4096 1000 0\n"
      "5 free_requested 8192 1000 0\n"
      "6 free_completed 8192 1000 0\n";
  const auto r = ccalloc::replay_trace(ccalloc::parse_trace_text(text, "gap"), {});
  EXPECT_EQ(r.peak_requested_bytes, 2000u);
  EXPECT_EQ(r.peak_allocated_bytes, 1024u);  // A is no longer allocated at line 3
  EXPECT_EQ(r.device_mallocs, 1u);           // one 2 MiB small segment
}

TEST(ReplayTest, ImmediateFreeReleasesRequestedBytesAtOnce) {
  const std::string text =
      "1 alloc 4096 1000 0\n"
      "2 free_requested 4096 1000 0\n"
      "3 free_completed 4096 1000 0\n"
      "4 alloc 8192 1000 0\n";
  const auto r = ccalloc::replay_trace(ccalloc::parse_trace_text(text, "nogap"), {});
  EXPECT_EQ(r.peak_requested_bytes, 1000u);
}

TEST(ReplayTest, FreeOfUnknownAddressNamesTheLine) {
  const std::string text =
      "1 alloc 4096 1000 0\n"
      "2 free_requested 9999 1000 0\n";
  try {
    (void)ccalloc::replay_trace(ccalloc::parse_trace_text(text, "bad.trace"), {});
    FAIL() << "expected trace_error";
  } catch (const ccalloc::trace_error& e) {
    EXPECT_EQ(e.line, 2u);
    EXPECT_NE(std::string(e.what()).find("bad.trace:2:"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("9999"), std::string::npos) << e.what();
  }
}

TEST(ReplayTest, AllocOverLiveAddressNamesBothLines) {
  const std::string text =
      "1 alloc 4096 1000 0\n"
      "2 alloc 4096 1000 0\n";
  try {
    (void)ccalloc::replay_trace(ccalloc::parse_trace_text(text, "dup.trace"), {});
    FAIL() << "expected trace_error";
  } catch (const ccalloc::trace_error& e) {
    EXPECT_NE(std::string(e.what()).find("dup.trace:2:"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("line 1"), std::string::npos) << e.what();
  }
}

TEST(ReplayTest, BadConfigIsRejectedBeforeReplaying) {
  ccalloc::replay_options o;
  o.config = "garbage_collection_threshold:1.5";
  EXPECT_THROW((void)ccalloc::replay_trace(ccalloc::parse_trace_text("", "empty"), o), ccalloc::config_error);
}

}  // namespace
