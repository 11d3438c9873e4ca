// sleep_wake_loop.cpp: an RL-style loop in which an inference engine and a
// trainer take turns on one device through ccalloc's sleep and wake (SPEC
// S1-S5). Each round:
//   generation  the inference tags are resumed: weights (kept across pauses)
//               and the KV cache (dropped), plus the default tag's
//               temporaries; then both inference tags are paused;
//   training    the trainer's tags are resumed: its optimizer state (kept)
//               and its scratch (activations and gradients, allocated and
//               freed every step, dropped); then paused.
// Printed per round: reserved bytes, paused bytes, device free memory, and
// the pause and resume times (the backend's host clock: on the simulated
// device the modelled cost of the page calls and host copies).
// Checked (exit status 1 when one fails):
//   - after every pause, device free memory rose by at least the paused
//     tags' reserved bytes less one 2 MiB page per block;
//   - peak reserved over the loop <= the larger phase's own peak (each run
//     alone on a fresh allocator) + 2%: nothing stranded between phases;
//   - the weights and the optimizer state hold their bytes after every
//     resume (simulated device: the bytes are host-addressable).
// Then one line of exact figures that a replay of the loop's trace
// reproduces: "replay figures: peak_reserved_bytes=... device_mallocs=...
// peak_paused_bytes=... pauses=...".
// Usage: sleep_wake_loop [--device sim|cuda] [--rounds N] [--trace FILE]
//                        [--snapshot FILE] [--bench]
//   --trace writes the loop as a trace in ccalloc's format (trace_writer:
//   allocations, tag changes, pauses and resumes), which `ccalloc replay
//   --device-memory 1GiB FILE` replays to the same figures;
//   --snapshot writes its memory history (ccalloc's snapshot JSON, with
//   pause and resume entries).
#include <ccalloc/backend/default_backend.hpp>
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/snapshot.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>
#include <ccalloc/replay/trace_writer.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace ccalloc;  // NOLINT: example program

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t page = 2 * MiB;

struct phase_sizes {
  std::size_t weights_blocks = 16, weights_bytes = 16 * MiB;  // 256 MiB kept
  std::size_t kv_blocks = 8, kv_bytes = 32 * MiB;             // 256 MiB dropped
  std::size_t temp_blocks = 8, temp_bytes = 8 * MiB;          // default-tag temporaries
  std::size_t state_blocks = 8, state_bytes = 16 * MiB;       // 128 MiB optimizer state, kept
  std::size_t scratch_blocks = 24, scratch_bytes = 16 * MiB;  // 384 MiB activations + gradients, dropped
};

struct loop {
  caching_allocator& a;
  device_backend& b;
  bool sim;
  phase_sizes z;
  std::vector<void*> weights, kv, state;
  bool failed = false;

  std::size_t free_bytes() { return b.mem_get_info(0).free_bytes; }
  std::size_t reserved() { return static_cast<std::size_t>(a.get_device_stats(0).reserved_bytes[0].current); }
  std::size_t peak_reserved() { return static_cast<std::size_t>(a.get_device_stats(0).reserved_bytes[0].peak); }
  tag_usage usage(const std::string& tag) {
    for (const tag_usage& u : a.tag_stats(0))
      if (u.tag == tag) return u;
    return {};
  }
  std::vector<void*> make(const char* tag, std::size_t n, std::size_t bytes, unsigned char seed) {
    tag_scope scope(tag);
    std::vector<void*> out;
    for (std::size_t i = 0; i < n; ++i) {
      out.push_back(a.malloc(0, bytes, default_stream));
      if (sim) {
        auto* p = static_cast<unsigned char*>(out.back());
        p[0] = static_cast<unsigned char>(seed + i);
        p[bytes - 1] = static_cast<unsigned char>(seed + i);
      }
    }
    return out;
  }
  void check_kept(const char* what, const std::vector<void*>& blocks, std::size_t bytes, unsigned char seed) {
    if (!sim) return;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      const auto* p = static_cast<const unsigned char*>(blocks[i]);
      if (p[0] != static_cast<unsigned char>(seed + i) || p[bytes - 1] != static_cast<unsigned char>(seed + i)) {
        std::printf("FAIL: %s block %zu lost its bytes across pause and resume\n", what, i);
        failed = true;
        return;
      }
    }
  }
  // Pauses `tags` and checks what the device gained. Returns the host time.
  std::uint64_t pause(const std::vector<std::string>& tags, bool keep) {
    std::size_t held = 0, blocks = 0;
    for (const std::string& t : tags) {
      const tag_usage u = usage(t);
      held += u.reserved_bytes;
      blocks += u.blocks;
    }
    const std::size_t before = free_bytes();
    const sleep_result r = a.pause(tags, keep);
    const std::size_t gained = free_bytes() - before;
    if (gained + blocks * page < held) {
      std::printf("FAIL: pausing %s freed %zu MiB of the %zu MiB its tags held (%zu blocks)\n", tags[0].c_str(),
                  gained / MiB, held / MiB, blocks);
      failed = true;
    }
    return r.host_time_us;
  }
  void generation(bool first) {
    std::vector<void*> temps;
    for (std::size_t i = 0; i < z.temp_blocks; ++i) temps.push_back(a.malloc(0, z.temp_bytes, default_stream));
    if (first) {
      weights = make("weights", z.weights_blocks, z.weights_bytes, 1);
      kv = make("kv_cache", z.kv_blocks, z.kv_bytes, 101);
    }
    for (void* p : temps) a.free(p);
  }
  void training(bool first) {
    if (first) state = make("train_state", z.state_blocks, z.state_bytes, 201);
    for (int step = 0; step < 2; ++step) {
      std::vector<void*> scratch = make("train_scratch", z.scratch_blocks, z.scratch_bytes, 0);
      for (void* p : scratch) a.free(p);
    }
  }
};

std::size_t phase_alone_peak(const std::shared_ptr<device_backend>& b, bool sim, bool inference) {
  caching_allocator a(b, allocator_config{});
  a.init(1);
  loop l{a, *b, sim, {}, {}, {}, {}, false};
  if (inference) l.generation(true);
  else l.training(true);
  const std::size_t peak = l.peak_reserved();
  for (void* p : l.weights) a.free(p);
  for (void* p : l.kv) a.free(p);
  for (void* p : l.state) a.free(p);
  a.empty_cache();
  return peak;
}

// --bench: pause and resume of 1 GiB under one tag (64 blocks of 16 MiB),
// with and without kept contents, 5 times each: the host wall time of the
// calls (steady clock) and, on the simulated device, the modelled time of
// the page calls and copies they made (host_time_us).
int bench(const std::shared_ptr<device_backend>& b) {
  caching_allocator a(b, allocator_config{});
  a.init(1);
  std::vector<void*> blocks;
  {
    tag_scope scope("bench");
    for (int i = 0; i < 64; ++i) {
      blocks.push_back(a.malloc(0, 16 * MiB, default_stream));
      if (b->name() == "sim") std::memset(blocks.back(), i, 16 * MiB);  // touched: the host pages exist
    }
  }
  std::printf("%-14s %8s %14s %14s\n", "what", "GiB", "wall_ms/GiB", "modelled_ms/GiB");
  for (bool keep : {false, true}) {
    for (int rep = 0; rep < 5; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      const sleep_result p = a.pause({"bench"}, keep);
      const auto t1 = std::chrono::steady_clock::now();
      const sleep_result r = a.resume({"bench"});
      const auto t2 = std::chrono::steady_clock::now();
      const double gib = static_cast<double>(p.paused_bytes) / (1024.0 * MiB);
      auto ms = [](auto d) { return std::chrono::duration<double, std::milli>(d).count(); };
      std::printf("%-14s %8.2f %14.3f %14.3f\n", keep ? "pause+keep" : "pause", gib, ms(t1 - t0) / gib,
                  static_cast<double>(p.host_time_us) / 1000.0 / gib);
      std::printf("%-14s %8.2f %14.3f %14.3f\n", keep ? "resume+restore" : "resume", gib, ms(t2 - t1) / gib,
                  static_cast<double>(r.host_time_us) / 1000.0 / gib);
    }
  }
  for (void* p : blocks) a.free(p);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string device = "sim";
  std::string trace_path, snapshot_path;
  int rounds = 20;
  bool bench_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--bench") bench_only = true;
    else if (arg == "--device" && i + 1 < argc) device = argv[++i];
    else if (arg == "--rounds" && i + 1 < argc) rounds = std::atoi(argv[++i]);
    else if (arg == "--trace" && i + 1 < argc) trace_path = argv[++i];
    else if (arg == "--snapshot" && i + 1 < argc) snapshot_path = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--device sim|cuda] [--rounds N] [--trace FILE] [--snapshot FILE] [--bench]\n",
                   argv[0]);
      return 2;
    }
  }
  if ((device != "sim" && device != "cuda") || rounds < 1) {
    std::fprintf(stderr, "sleep_wake_loop: --device is sim or cuda, --rounds at least 1\n");
    return 2;
  }
  try {
    std::shared_ptr<device_backend> b;
    const bool sim = device == "sim";
    if (sim) {
      sim_options o;
      o.capacity_bytes = 1024 * MiB;  // both phases fit only if the other one sleeps
      o.host_clock_mode = sim_options::host_clock::modeled;
      b = std::make_shared<sim_backend>(o);
    } else {
      b = make_default_backend();
      if (b->name() != "cuda") {
        std::fprintf(stderr, "sleep_wake_loop: --device cuda, but no GPU is usable here\n");
        return 2;
      }
    }
    if (bench_only) return bench(b);
    const std::size_t inference_peak = phase_alone_peak(b, sim, true);
    const std::size_t training_peak = phase_alone_peak(b, sim, false);
    caching_allocator a(b, allocator_config{});
    a.init(1);
    if (!snapshot_path.empty()) a.record_history(history_options{});
    std::unique_ptr<trace_writer> writer;
    if (!trace_path.empty()) writer = std::make_unique<trace_writer>(a, 0);
    loop l{a, *b, sim, {}, {}, {}, {}, false};
    std::size_t peak_paused = 0;
    int pauses = 0;
    std::printf("device %s; alone: inference peak %zu MiB, training peak %zu MiB\n", device.c_str(),
                inference_peak / MiB, training_peak / MiB);
    std::printf("%5s %-10s %12s %10s %12s %10s %10s\n", "round", "phase", "reserved_MiB", "paused_MiB",
                "dev_free_MiB", "pause_us", "resume_us");
    auto paused_mib = [&] {
      std::size_t n = 0;
      for (const tag_usage& u : a.tag_stats(0)) n += u.paused_bytes;
      peak_paused = std::max(peak_paused, n);
      return n / MiB;
    };
    for (int round = 0; round < rounds; ++round) {
      const bool first = round == 0;
      std::uint64_t resume_us = 0;
      if (!first) resume_us = a.resume({"weights", "kv_cache"}).host_time_us;
      l.check_kept("weights", l.weights, l.z.weights_bytes, 1);
      l.generation(first);
      const std::size_t reserved_gen = l.reserved();
      const std::uint64_t pause_us = l.pause({"weights"}, true) + l.pause({"kv_cache"}, false);
      pauses += 2;
      std::printf("%5d %-10s %12zu %10zu %12zu %10llu %10llu\n", round, "generation", reserved_gen / MiB,
                  paused_mib(), l.free_bytes() / MiB, static_cast<unsigned long long>(pause_us),
                  static_cast<unsigned long long>(resume_us));
      std::uint64_t train_resume_us = 0;
      if (!first) train_resume_us = a.resume({"train_state", "train_scratch"}).host_time_us;
      l.check_kept("train_state", l.state, l.z.state_bytes, 201);
      l.training(first);
      const std::size_t reserved_train = l.reserved();
      const std::uint64_t train_pause_us = l.pause({"train_state"}, true) + l.pause({"train_scratch"}, false);
      pauses += 2;
      std::printf("%5d %-10s %12zu %10zu %12zu %10llu %10llu\n", round, "training", reserved_train / MiB,
                  paused_mib(), l.free_bytes() / MiB, static_cast<unsigned long long>(train_pause_us),
                  static_cast<unsigned long long>(train_resume_us));
    }
    const std::size_t peak = l.peak_reserved();
    const std::size_t bound = std::max(inference_peak, training_peak) * 102 / 100;
    std::printf("peak reserved %zu MiB; larger phase alone %zu MiB (+2%%: %zu MiB)\n", peak / MiB,
                std::max(inference_peak, training_peak) / MiB, bound / MiB);
    if (peak > bound) {
      std::printf("FAIL: memory was stranded between phases\n");
      l.failed = true;
    }
    std::printf("replay figures: peak_reserved_bytes=%zu device_mallocs=%lld peak_paused_bytes=%zu pauses=%d\n",
                peak, static_cast<long long>(a.get_device_stats(0).num_device_alloc), peak_paused, pauses);
    if (writer) writer->write(trace_path);  // the loop as it ends: every tag asleep
    if (!snapshot_path.empty()) {
      std::ofstream out(snapshot_path);
      out << to_json(a.snapshot());
      if (!out) throw std::runtime_error("cannot write " + snapshot_path);
    }
    a.resume({"weights", "kv_cache", "train_state", "train_scratch"});
    for (void* p : l.weights) a.free(p);
    for (void* p : l.kv) a.free(p);
    for (void* p : l.state) a.free(p);
    if (sim) {
      const sim_counters c = static_cast<sim_backend&>(*b).counters();
      if (c.unmapped_uses != 0 || c.unsafe_unmaps != 0) {
        std::printf("FAIL: unsafe device use (%llu unmapped uses, %llu unsafe unmaps)\n",
                    static_cast<unsigned long long>(c.unmapped_uses),
                    static_cast<unsigned long long>(c.unsafe_unmaps));
        l.failed = true;
      }
    }
    std::printf(l.failed ? "FAILED\n" : "all checks passed\n");
    return l.failed ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sleep_wake_loop: %s\n", e.what());
    return 1;
  }
}
