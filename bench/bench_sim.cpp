// bench/bench_sim.cpp: the SPEC P cases on the simulated device, so the
// allocator's CPU cost (its hot path) can be tracked on any machine.
//
// What is measured: the host time of ccalloc::caching_allocator::malloc + free
// over sim_backend. The simulated device does no work per cached allocation,
// so these figures are ccalloc's own cost; on a GPU the CUDA backend adds
// nothing to a cache hit either (bench/gpu/bench_gpu.cpp measures it there).
//
//   BM_pair/size:N        alloc+free of N bytes on one stream, warm cache;
//                         Time = ns per pair (SPEC P1).
//   BM_mixed              64 live blocks, random sizes 512 B - 64 MiB; each
//                         iteration frees a random slot and allocates a new
//                         random size there (bench/common/cases.hpp);
//                         Time = ns per pair (SPEC P2).
//   BM_mixed_history/context:C  BM_mixed with the memory history recorded
//                         (a ring of 100,000 entries): C = 0 without contexts,
//                         C = 1 with a context recorder at every malloc and
//                         free (record_context::all; the recorder hands back
//                         one shared context, so this is ccalloc's own cost of
//                         keeping contexts, not a stack walk's); Time = ns per
//                         pair, to compare with BM_mixed (history off).
//   BM_threads/threads:T  1 MiB pairs, T threads, each on its own stream;
//                         items_per_second = pairs/s of all threads (SPEC P3).
//   BM_churn              8 live blocks of 1-128 MiB, each iteration frees the
//                         oldest and allocates the next size (default
//                         configuration: expandable segments map and recycle
//                         pages); Time = ns per step.
//   BM_grow/live:N        N live blocks of about 1.5 MiB on a fresh allocator
//                         (default configuration), then each iteration
//                         allocates 2 MiB more, kept live: a malloc that maps
//                         a new page at a new peak, as a model's first step
//                         does; Time = ns per malloc (issue D4: it walked
//                         every block, 0.8 ms at 32k live blocks).
//   BM_cross              1 MiB blocks allocated by this thread and freed by a
//                         second one (a queue of 64); Time = ns per pair.
//   BM_replay/NAME        replay of a real trace on a fresh simulated device;
//                         items_per_second = trace events/s (SPEC P5).
//
// DoNotOptimize gets const lvalues only (a local copy of the pointer): with a
// non-const one, Google Benchmark's asm ("+m,r") lets GCC 12 delete the store
// into the ring slot it names (RTL dead-store elimination; reproduced here,
// 2026-12-01: the ring kept a freed pointer, the free at the end failed;
// google/benchmark#2282).
//
// Traces: data/traces/gpt2_train.trace.gz and ../shared/traces/
// llama_generate.trace.gz when present; CCALLOC_BENCH_TRACES (paths separated
// by ':') replaces that list.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/core/history.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>
#ifdef CCALLOC_BENCH_HAVE_REPLAY
#include <ccalloc/replay/replay.hpp>
#include <ccalloc/replay/trace.hpp>
#endif

#include "common/cases.hpp"

#include <benchmark/benchmark.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <thread>
#include <memory>
#include <string>
#include <vector>

namespace {

namespace cb = ccalloc::bench;

/// One allocator over one simulated device, shared by every benchmark (as a
/// process holds one allocator), with a stream per thread made up front.
struct sim_env {
  // The allocator's time budgets see what a program on a GPU would: the
  // steady clock plus an H200's cost for each virtual-memory call.
  static ccalloc::sim_options options() {
    ccalloc::sim_options o;
    o.host_clock_mode = ccalloc::sim_options::host_clock::steady;
    return o;
  }
  std::shared_ptr<ccalloc::sim_backend> backend = std::make_shared<ccalloc::sim_backend>(options());
  ccalloc::caching_allocator allocator{backend};
  std::vector<ccalloc::stream_t> streams;

  sim_env() {
    allocator.init(1);
    for (int i = 0; i < cb::max_threads; ++i) streams.push_back(backend->create_stream(0));
  }
};

sim_env& env() {
  static sim_env e;
  return e;
}

void BM_pair(benchmark::State& state) {
  auto& e = env();
  const auto size_bytes = static_cast<std::size_t>(state.range(0));
  const ccalloc::stream_t stream = e.streams[0];
  e.allocator.free(e.allocator.malloc(0, size_bytes, stream));  // warm the cache
  for (auto _ : state) {
    void* const ptr = e.allocator.malloc(0, size_bytes, stream);
    benchmark::DoNotOptimize(ptr);
    e.allocator.free(ptr);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_pair)->ArgName("size")->Arg(512)->Arg(4 << 10)->Arg(1 << 20)->Arg(16 << 20)->Arg(256 << 20);

void run_mixed(benchmark::State& state) {
  static const cb::mixed_plan plan = cb::make_mixed_plan();
  auto& e = env();
  const ccalloc::stream_t stream = e.streams[0];
  std::vector<void*> ring(cb::mixed_slots);
  for (std::size_t i = 0; i < cb::mixed_slots; ++i)
    ring[i] = e.allocator.malloc(0, plan.initial_sizes_bytes[i], stream);
  // Warm-up: one pass of the sequence, so the cache holds what the run needs.
  for (const auto& step : plan.steps) {
    e.allocator.free(ring[step.slot]);
    ring[step.slot] = e.allocator.malloc(0, step.size_bytes, stream);
  }
  std::size_t pos = 0;
  for (auto _ : state) {
    const auto& step = plan.steps[pos];
    pos = pos + 1 == plan.steps.size() ? 0 : pos + 1;
    e.allocator.free(ring[step.slot]);
    void* const ptr = e.allocator.malloc(0, step.size_bytes, stream);
    benchmark::DoNotOptimize(ptr);  // a const lvalue: see the file's comment on DoNotOptimize
    ring[step.slot] = ptr;
  }
  state.SetItemsProcessed(state.iterations());
  for (void* ptr : ring) e.allocator.free(ptr);
}

void BM_mixed(benchmark::State& state) { run_mixed(state); }
BENCHMARK(BM_mixed);

void BM_mixed_history(benchmark::State& state) {
  auto& e = env();
  ccalloc::history_options on;
  on.max_entries = 100000;
  on.when = state.range(0) != 0 ? ccalloc::record_context::all : ccalloc::record_context::never;
  if (state.range(0) != 0) {
    auto context = std::make_shared<const ccalloc::trace_context>(
        std::vector<ccalloc::stack_frame>{{"step", "bench_sim.cpp", 1}, {"main", "bench_sim.cpp", 2}});
    on.recorder = [context] { return context; };
  }
  e.allocator.record_history(on);
  run_mixed(state);
  ccalloc::history_options off;
  off.enabled = false;
  e.allocator.record_history(off);  // the other benchmarks share this allocator
}
BENCHMARK(BM_mixed_history)->ArgName("context")->Arg(0)->Arg(1);

void BM_threads(benchmark::State& state) {
  auto& e = env();
  const ccalloc::stream_t stream = e.streams[static_cast<std::size_t>(state.thread_index())];
  e.allocator.free(e.allocator.malloc(0, cb::threads_pair_bytes, stream));  // warm this stream
  for (auto _ : state) {
    void* const ptr = e.allocator.malloc(0, cb::threads_pair_bytes, stream);
    benchmark::DoNotOptimize(ptr);
    e.allocator.free(ptr);
  }
  state.SetItemsProcessed(state.iterations());  // summed over threads: total pairs/s
}
BENCHMARK(BM_threads)->Threads(1)->Threads(2)->Threads(4)->Threads(8)->Threads(16)->UseRealTime();

void BM_churn(benchmark::State& state) {
  static const std::vector<std::size_t> sizes = cb::make_churn_sizes();
  auto& e = env();
  const ccalloc::stream_t stream = e.streams[0];
  std::vector<void*> ring(cb::churn_slots);
  for (std::size_t i = 0; i < cb::churn_slots; ++i) ring[i] = e.allocator.malloc(0, sizes[i], stream);
  std::size_t next = cb::churn_slots;
  std::size_t oldest = 0;
  for (auto _ : state) {
    e.allocator.free(ring[oldest]);
    void* const ptr = e.allocator.malloc(0, sizes[next], stream);
    benchmark::DoNotOptimize(ptr);
    ring[oldest] = ptr;
    oldest = oldest + 1 == cb::churn_slots ? 0 : oldest + 1;
    next = next + 1 == sizes.size() ? cb::churn_slots : next + 1;
  }
  state.SetItemsProcessed(state.iterations());
  for (void* ptr : ring) e.allocator.free(ptr);
  e.allocator.empty_cache();
}
BENCHMARK(BM_churn);

void BM_grow(benchmark::State& state) {
  const auto live_blocks = static_cast<std::size_t>(state.range(0));
  auto backend = std::make_shared<ccalloc::sim_backend>(sim_env::options());
  ccalloc::caching_allocator allocator{backend};
  allocator.init(1);
  std::vector<void*> live;
  live.reserve(live_blocks + static_cast<std::size_t>(state.max_iterations));
  for (std::size_t i = 0; i < live_blocks; ++i) live.push_back(allocator.malloc(0, (1536 << 10) + i % 3 * 512, 0));
  const std::int64_t mapped_before = allocator.get_device_stats(0).num_pages_mapped;
  for (auto _ : state) {
    void* const ptr = allocator.malloc(0, 2 << 20, 0);
    benchmark::DoNotOptimize(ptr);  // a const lvalue: see the file's comment on DoNotOptimize
    live.push_back(ptr);
  }
  state.counters["pages_mapped_per_malloc"] =
      static_cast<double>(allocator.get_device_stats(0).num_pages_mapped - mapped_before) /
      static_cast<double>(state.iterations());
  state.SetItemsProcessed(state.iterations());
  for (void* ptr : live) allocator.free(ptr);
}
BENCHMARK(BM_grow)->ArgName("live")->Arg(2000)->Arg(8000)->Arg(32000)->Iterations(2000)->Unit(benchmark::kMicrosecond);

void BM_cross(benchmark::State& state) {
  auto& e = env();
  const ccalloc::stream_t stream = e.streams[0];
  std::array<std::atomic<void*>, cb::cross_queue_depth> queue{};
  std::atomic<bool> done{false};
  std::thread consumer([&] {  // frees what this thread allocates, in order
    for (std::size_t i = 0;; i = i + 1 == cb::cross_queue_depth ? 0 : i + 1) {
      void* p = nullptr;
      while ((p = queue[i].load(std::memory_order_acquire)) == nullptr) {
        if (done.load(std::memory_order_acquire) && queue[i].load(std::memory_order_acquire) == nullptr) return;
        std::this_thread::yield();  // a busy machine may have fewer cores than threads
      }
      queue[i].store(nullptr, std::memory_order_release);
      e.allocator.free(p);
    }
  });
  std::size_t tail = 0;
  for (auto _ : state) {
    void* p = e.allocator.malloc(0, cb::cross_pair_bytes, stream);
    while (queue[tail].load(std::memory_order_acquire) != nullptr) std::this_thread::yield();
    queue[tail].store(p, std::memory_order_release);
    tail = tail + 1 == cb::cross_queue_depth ? 0 : tail + 1;
  }
  done.store(true, std::memory_order_release);
  consumer.join();
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_cross)->UseRealTime();

#ifdef CCALLOC_BENCH_HAVE_REPLAY
void BM_replay(benchmark::State& state, const std::string& path) {
  // Read once, outside the timing (the trace reader is not what P5 measures).
  static std::vector<std::pair<std::string, ccalloc::trace>> cache;
  const ccalloc::trace* t = nullptr;
  for (const auto& [p, tr] : cache)
    if (p == path) t = &tr;
  if (t == nullptr) t = &cache.emplace_back(path, ccalloc::read_trace_file(path)).second;
  std::uint64_t events = 0;
  for (auto _ : state) {
    const ccalloc::replay_result r = ccalloc::replay_trace(*t, ccalloc::replay_options{});
    events = r.events;
    benchmark::DoNotOptimize(r.peak_reserved_bytes);
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(events) * state.iterations());
  state.counters["events"] = static_cast<double>(events);
}

std::vector<std::string> trace_paths() {
  std::vector<std::string> paths;
  if (const char* env_list = std::getenv("CCALLOC_BENCH_TRACES")) {
    std::string s = env_list;
    std::size_t start = 0;
    while (start <= s.size()) {
      const std::size_t end = s.find(':', start);
      const std::string item = s.substr(start, end == std::string::npos ? std::string::npos : end - start);
      if (!item.empty()) paths.push_back(item);
      if (end == std::string::npos) break;
      start = end + 1;
    }
    return paths;
  }
  for (const char* p : {CCALLOC_SOURCE_DIR "/data/traces/gpt2_train.trace.gz",
                        CCALLOC_SOURCE_DIR "/../shared/traces/llama_generate.trace.gz"})
    if (std::filesystem::exists(p)) paths.emplace_back(p);
  return paths;
}

void register_replay_benchmarks() {
  for (const auto& path : trace_paths()) {
    std::string name = std::filesystem::path(path).filename().string();
    for (const char* suffix : {".gz", ".trace"})
      if (name.ends_with(suffix)) name.resize(name.size() - std::string(suffix).size());
    benchmark::RegisterBenchmark(("BM_replay/" + name).c_str(), BM_replay, path)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
}
#endif

}  // namespace

int main(int argc, char** argv) {
#ifdef CCALLOC_BENCH_HAVE_REPLAY
  register_replay_benchmarks();
#endif
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
