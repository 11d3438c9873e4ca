// stress_test.cpp (issue 9, SPEC R1/X1): many threads on many streams of two
// simulated devices, racing every operation that can race, with the
// invariants checked at quiescent points. CTest label "concurrent": the
// ThreadSanitizer build of scripts/test.sh runs it.
//
// Each round, every worker thread does a burst of random operations while a
// disturber thread races the slow paths; then all of them meet at a barrier
// (std::barrier), whose completion step checks, with nothing running:
//   - device_caching_allocator::check_invariants() on both devices (tiling,
//     merging, pool membership, statistics equal a recount);
//   - allocation.all.current on each device = the blocks the threads hold;
//   - no two live allocations overlap;
//   - every live block still holds the tags its owner wrote at both ends (a
//     block handed out twice would have them overwritten).
// Worker operations: malloc on a random (device, stream) with sizes from
// 1 B to 48 MiB (and now and then 1 EiB), free, record_stream on another
// stream of the device with work queued there (also on a pointer inside the
// block, SPEC X4), handing a pointer to another thread to free (cross-thread
// frees of blocks recorded on other streams), empty_cache, cache_info.
// Disturber: advances the virtual clock, empty_cache, set_memory_fraction
// (0.5..1 on either device), get_device_stats, reset_peak_stats.
// Device 1 is small (160 MiB) so that out-of-memory errors happen; each is
// checked to be an out_of_memory_error naming the device.
//
// Reuse before the events complete (SPEC B4): before freeing a block it
// recorded on another stream, a worker writes a release header at the block's
// start: the time at which the work queued on that stream completes. Whoever
// gets memory at that address later reads the header first and checks that
// the virtual clock has passed that time (a stale header is harmless: the
// clock only moves forward).
//
// At the end every pointer is freed, empty_cache returns every segment, and
// the simulated device holds no segment and no event.
//
// Length: CCALLOC_STRESS_ROUNDS (default 6 rounds of 400 operations per
// worker; about a second in a normal build) runs it longer, e.g.
//   CCALLOC_STRESS_ROUNDS=2000 build/tests/ccalloc_concurrent_tests --gtest_filter='Stress*'
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace ccalloc;  // NOLINT: test file

constexpr int device_count = 2;
constexpr int streams_per_device = 4;
constexpr int workers = 6;
constexpr int ops_per_round = 400;
constexpr std::size_t small_device_bytes = 160 * mib;

int rounds_from_environment() {
  const char* text = std::getenv("CCALLOC_STRESS_ROUNDS");
  if (text == nullptr || *text == '\0') return 6;
  const int rounds = std::atoi(text);
  return rounds > 0 ? rounds : 6;
}

// What a worker writes at both ends of a live block: its thread and serial.
struct tag {
  std::uint64_t owner;
  std::uint64_t serial;
};

// Written at a block's start just before a free that must wait on events.
struct release_header {
  static constexpr std::uint64_t magic_value = 0x5e1ea5e0c0ffee11;
  std::uint64_t magic;
  std::uint64_t not_before;  // virtual time the recorded stream's work completes
  std::uint64_t check;       // magic ^ not_before: a torn or stale-garbage header does not match
};

struct live_block {
  void* ptr = nullptr;
  std::size_t size = 0;  // requested bytes
  int device = 0;
  stream_t stream = 0;  // the stream it was allocated on
  tag mark{};
};

struct stress_world {
  std::shared_ptr<sim_backend> sim;
  std::unique_ptr<caching_allocator> alloc;
  std::vector<std::vector<stream_t>> streams;  // per device

  std::mutex handoff_mutex;
  std::vector<live_block> handoff;  // pointers waiting for another thread to free them

  std::atomic<long> mallocs{0}, ooms{0}, frees{0}, records{0}, early_reuse{0}, bad_errors{0};
  std::mutex failure_mutex;
  std::vector<std::string> failures;

  void fail(std::string what) {
    std::lock_guard lock(failure_mutex);
    if (failures.size() < 20) failures.push_back(std::move(what));
  }
};

void write_tag(const live_block& b) {
  std::memcpy(b.ptr, &b.mark, sizeof(tag));
  if (b.size >= 2 * sizeof(tag))
    std::memcpy(static_cast<char*>(b.ptr) + b.size - sizeof(tag), &b.mark, sizeof(tag));
}

bool tag_intact(const live_block& b) {
  tag front{}, back{};
  std::memcpy(&front, b.ptr, sizeof(tag));
  if (front.owner != b.mark.owner || front.serial != b.mark.serial) return false;
  if (b.size < 2 * sizeof(tag)) return true;
  std::memcpy(&back, static_cast<char*>(b.ptr) + b.size - sizeof(tag), sizeof(tag));
  return back.owner == b.mark.owner && back.serial == b.mark.serial;
}

class worker {
 public:
  worker(stress_world& w, int id) : w_(w), id_(id), rng_(0x5eed0000u + static_cast<unsigned>(id)) {}

  std::vector<live_block>& live() { return live_; }

  void run_round() {
    for (int i = 0; i < ops_per_round; ++i) step();
  }

  void release_all() {
    for (auto& b : live_) free_block(b);
    live_.clear();
  }

 private:
  std::size_t pick_size() {
    // Log-uniform over 1 B .. 48 MiB, weighted to small sizes as real programs are.
    const std::size_t roll = rng_() % 100;
    if (roll < 55) return 1 + rng_() % (64 * kib);
    if (roll < 85) return 1 + rng_() % (2 * mib);
    if (roll < 97) return 1 + rng_() % (12 * mib);
    return 1 + rng_() % (48 * mib);
  }

  void step() {
    const std::size_t roll = rng_() % 1000;
    if (roll < 450 || live_.empty()) return do_malloc();
    if (roll < 750) return do_free(rng_() % live_.size());
    if (roll < 850) return do_handoff();
    if (roll < 930) return do_record_and_free();
    if (roll < 960) return do_record_interior();
    if (roll < 975) return w_.alloc->empty_cache();
    if (roll < 990) return void(w_.alloc->cache_info(static_cast<int>(rng_() % device_count)));
    return do_huge();
  }

  void do_malloc() {
    const int device = static_cast<int>(rng_() % device_count);
    const auto& streams = w_.streams[static_cast<std::size_t>(device)];
    const stream_t stream = streams[rng_() % streams.size()];
    const std::size_t size = pick_size();
    void* p = nullptr;
    try {
      p = w_.alloc->malloc(device, size, stream);
    } catch (const out_of_memory_error& e) {
      ++w_.ooms;
      if (e.device != device || std::string(e.what()).find("out of memory on device " + std::to_string(device)) ==
                                    std::string::npos) {
        ++w_.bad_errors;
        w_.fail(std::string("out_of_memory_error does not name device ") + std::to_string(device) + ": " + e.what());
      }
      return;
    }
    ++w_.mallocs;
    check_release_header(p, std::min(size, sizeof(release_header)));
    live_block b{p, size, device, stream, tag{static_cast<std::uint64_t>(id_) + 1, ++serial_}};
    write_tag(b);
    live_.push_back(b);
  }

  // A block whose start holds a valid release header must not be handed out
  // before the virtual clock passed the time in it.
  void check_release_header(void* p, std::size_t readable) {
    if (readable < sizeof(release_header)) return;
    release_header h{};
    std::memcpy(&h, p, sizeof h);
    if (h.magic != release_header::magic_value || h.check != (h.magic ^ h.not_before)) return;
    const std::uint64_t now = w_.sim->now();
    if (now < h.not_before) {
      ++w_.early_reuse;
      w_.fail("block " + std::to_string(reinterpret_cast<std::uintptr_t>(p)) + " handed out at time " +
              std::to_string(now) + ", before the work recorded on it completes at " + std::to_string(h.not_before));
    }
  }

  void free_block(const live_block& b, bool expect_intact = true) {
    if (expect_intact && !tag_intact(b)) {
      w_.fail("the tags of block " + std::to_string(reinterpret_cast<std::uintptr_t>(b.ptr)) +
              " were overwritten while its owner held it");
    }
    // A plain free leaves no release header behind (a stale one could only be
    // too early to matter, but clearing it keeps the check meaningful).
    if (b.size >= sizeof(release_header)) std::memset(b.ptr, 0, sizeof(release_header));
    w_.alloc->free(b.ptr);
    ++w_.frees;
  }

  void do_free(std::size_t k) {
    free_block(live_[k]);
    live_[k] = live_.back();
    live_.pop_back();
  }

  // A stream of the block's device other than its own (a use on its own
  // stream needs no event: stream order protects it).
  stream_t other_stream(const live_block& b) {
    const auto& streams = w_.streams[static_cast<std::size_t>(b.device)];
    const std::size_t own = static_cast<std::size_t>(std::find(streams.begin(), streams.end(), b.stream) - streams.begin());
    return streams[(own + 1 + rng_() % (streams.size() - 1)) % streams.size()];
  }

  // record_stream on another stream with work queued there, then a release
  // header and the free (which must wait for that work).
  void do_record_and_free() {
    const std::size_t k = rng_() % live_.size();
    live_block b = live_[k];
    live_[k] = live_.back();
    live_.pop_back();
    const stream_t s = other_stream(b);
    w_.sim->enqueue_work(b.device, s, w_.sim->now() + 1 + rng_() % 40);
    w_.alloc->record_stream(b.ptr, s);
    ++w_.records;
    if (!tag_intact(b)) w_.fail("tags overwritten before record_stream");
    if (b.size >= sizeof(release_header)) {
      release_header h{release_header::magic_value, w_.sim->busy_until(b.device, s), 0};
      h.check = h.magic ^ h.not_before;
      std::memcpy(b.ptr, &h, sizeof h);
    }
    w_.alloc->free(b.ptr);
    ++w_.frees;
  }

  // record_stream through a pointer inside the block (a view, SPEC X4); the
  // block stays live and is freed later, maybe by another thread.
  void do_record_interior() {
    const live_block& b = live_[rng_() % live_.size()];
    if (b.size < 1024) return;
    const stream_t s = other_stream(b);
    w_.sim->enqueue_work(b.device, s, w_.sim->now() + 1 + rng_() % 40);
    w_.alloc->record_stream(static_cast<char*>(b.ptr) + b.size / 2, s);
    ++w_.records;
  }

  // Gives a block to whichever thread comes next (maybe on another device's
  // stream work), and frees the oldest handed-off one: cross-thread frees.
  void do_handoff() {
    const std::size_t k = rng_() % live_.size();
    live_block mine = live_[k];
    live_[k] = live_.back();
    live_.pop_back();
    if (rng_() % 2 == 0) {
      const stream_t s = other_stream(mine);
      w_.alloc->record_stream(mine.ptr, s);
      ++w_.records;
    }
    live_block theirs{};
    {
      std::lock_guard lock(w_.handoff_mutex);
      w_.handoff.push_back(mine);
      if (w_.handoff.size() <= 6) return;
      theirs = w_.handoff.front();
      w_.handoff.erase(w_.handoff.begin());
    }
    free_block(theirs);
  }

  void do_huge() {
    const int device = static_cast<int>(rng_() % device_count);
    try {
      (void)w_.alloc->malloc(device, max_request_bytes, w_.streams[static_cast<std::size_t>(device)][0]);
      w_.fail("a 1 EiB request succeeded");
    } catch (const out_of_memory_error& e) {
      if (e.requested_bytes != max_request_bytes) w_.fail(std::string("1 EiB OOM reports ") + e.what());
    }
  }

  stress_world& w_;
  int id_;
  std::mt19937_64 rng_;
  std::uint64_t serial_ = 0;
  std::vector<live_block> live_;
};

void disturb(stress_world& w, std::mt19937_64& rng, int ops) {
  for (int i = 0; i < ops; ++i) {
    const int device = static_cast<int>(rng() % device_count);
    switch (rng() % 8) {
      case 0: w.alloc->empty_cache(); break;
      case 1: w.alloc->set_memory_fraction(0.5 + 0.5 * static_cast<double>(rng() % 101) / 100.0, device); break;
      case 2: (void)w.alloc->get_device_stats(device); break;
      case 3: w.alloc->reset_peak_stats(device); break;
      default: w.sim->advance_to(w.sim->now() + 1 + rng() % 4); break;
    }
    std::this_thread::yield();
  }
}

// The quiescent-point checks; returns "" or what is wrong.
std::string check_quiescent(stress_world& w, std::vector<worker>& ws) {
  std::ostringstream err;
  std::vector<live_block> all;
  for (auto& wk : ws) all.insert(all.end(), wk.live().begin(), wk.live().end());
  all.insert(all.end(), w.handoff.begin(), w.handoff.end());
  for (int d = 0; d < device_count; ++d) {
    try {
      w.alloc->device_allocator(d).check_invariants();
    } catch (const std::exception& e) {
      err << "device " << d << ": " << e.what() << "; ";
    }
    const auto held = std::count_if(all.begin(), all.end(), [d](const live_block& b) { return b.device == d; });
    const auto st = w.alloc->get_device_stats(d);
    if (st.allocation[0].current != held)
      err << "device " << d << ": allocation.all.current " << st.allocation[0].current << " but threads hold "
          << held << "; ";
  }
  std::sort(all.begin(), all.end(), [](const live_block& a, const live_block& b) { return a.ptr < b.ptr; });
  for (std::size_t i = 1; i < all.size(); ++i) {
    const auto end = reinterpret_cast<std::uintptr_t>(all[i - 1].ptr) + all[i - 1].size;
    if (end > reinterpret_cast<std::uintptr_t>(all[i].ptr)) err << "live blocks overlap at " << all[i].ptr << "; ";
  }
  for (const auto& b : all)
    if (!tag_intact(b)) err << "live block " << b.ptr << " lost its tags; ";
  return err.str();
}

struct stress_case {
  const char* name;
  const char* conf;
};

// How ctest lists a case (GoogleTest prints an unknown type as its bytes).
void PrintTo(const stress_case& c, std::ostream* os) { *os << c.name << " (\"" << c.conf << "\")"; }

class StressTest : public ::testing::TestWithParam<stress_case> {};

TEST_P(StressTest, ThreadsStreamsDevicesRaceAndInvariantsHoldAtQuiescentPoints) {
  const int rounds = rounds_from_environment();
  stress_world w;
  w.sim = std::make_shared<sim_backend>(sim_options{device_count, std::size_t{1} << 30, 2 * mib});
  w.sim->set_capacity(1, small_device_bytes);
  w.alloc = std::make_unique<caching_allocator>(w.sim, allocator_config::parse(GetParam().conf));
  w.alloc->init(device_count);
  w.streams.resize(device_count);
  for (int d = 0; d < device_count; ++d) {
    w.streams[static_cast<std::size_t>(d)].push_back(default_stream);
    for (int s = 1; s < streams_per_device; ++s) w.streams[static_cast<std::size_t>(d)].push_back(w.sim->create_stream(d));
  }

  std::vector<worker> ws;
  for (int t = 0; t < workers; ++t) ws.emplace_back(w, t);
  int quiescent_checks = 0;
  auto at_barrier = [&]() noexcept {
    ++quiescent_checks;
    const std::string problem = check_quiescent(w, ws);
    if (!problem.empty()) w.fail("quiescent point " + std::to_string(quiescent_checks) + ": " + problem);
  };
  std::barrier sync(workers + 1, at_barrier);

  std::vector<std::thread> threads;
  for (int t = 0; t < workers; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < rounds; ++r) {
        ws[static_cast<std::size_t>(t)].run_round();
        sync.arrive_and_wait();
      }
    });
  }
  threads.emplace_back([&] {
    std::mt19937_64 rng(77);
    for (int r = 0; r < rounds; ++r) {
      disturb(w, rng, ops_per_round / 4);
      sync.arrive_and_wait();
    }
  });
  for (auto& t : threads) t.join();

  for (const auto& f : w.failures) ADD_FAILURE() << f;
  std::printf("stress %s: %d rounds, %ld mallocs, %ld frees, %ld record_stream, %ld out-of-memory errors\n",
              GetParam().name, rounds, w.mallocs.load(), w.frees.load(), w.records.load(), w.ooms.load());
  EXPECT_EQ(quiescent_checks, rounds);
  EXPECT_GT(w.mallocs.load(), rounds * workers * ops_per_round / 4);
  EXPECT_GT(w.records.load(), 0);
  EXPECT_GT(w.ooms.load(), 0) << "device 1 (160 MiB) should run out of memory now and then";
  EXPECT_EQ(w.early_reuse.load(), 0);
  EXPECT_EQ(w.bad_errors.load(), 0);

  // Everything returns: free what is left, let all queued work complete,
  // empty the cache.
  for (auto& wk : ws) wk.release_all();
  for (const auto& b : w.handoff) w.alloc->free(b.ptr);
  w.handoff.clear();
  w.alloc->empty_cache();
  for (int d = 0; d < device_count; ++d) {
    w.alloc->device_allocator(d).check_invariants();
    const auto st = w.alloc->get_device_stats(d);
    EXPECT_EQ(st.allocation[0].current, 0) << "device " << d;
    EXPECT_EQ(st.active_bytes[0].current, 0) << "device " << d;
    EXPECT_EQ(st.requested_bytes[0].current, 0) << "device " << d;
    EXPECT_EQ(st.reserved_bytes[0].current, 0) << "device " << d;
  }
  EXPECT_EQ(w.sim->counters().used_bytes, 0u);
  EXPECT_EQ(w.sim->counters().segment_mallocs, w.sim->counters().segment_frees);
  w.alloc.reset();
  EXPECT_EQ(w.sim->counters().live_events, 0u) << "the allocator's events were not all destroyed";
}

INSTANTIATE_TEST_SUITE_P(
    Stress, StressTest,
    ::testing::Values(stress_case{"default", ""},
                      stress_case{"split_gc_unlocked_malloc",
                                  "max_split_size_mb:40,garbage_collection_threshold:0.7,"
                                  "release_lock_on_cudamalloc:True,roundup_power2_divisions:4"},
                      stress_case{"pytorch_exact", "trim_on_new_peak:False"}),
    [](const ::testing::TestParamInfo<stress_case>& param_info) { return std::string(param_info.param.name); });

}  // namespace
