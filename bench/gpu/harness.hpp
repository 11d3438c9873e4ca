// bench/gpu/harness.hpp: the SPEC P cases on a real GPU, for any allocator.
//
// Used by bench_gpu.cpp (ccalloc, cudaMallocAsync, CUB, cudaMalloc) and by
// bench_torch.cpp (PyTorch's native allocator, built outside CMake), so that
// every allocator runs the same code on the same sizes. Only the standard
// library and the CUDA runtime API.
//
// An allocator adapter is a class with
//   static constexpr const char* name;       // "ccalloc", "torch", ...
//   void* alloc(std::size_t size_bytes, cudaStream_t stream);
//   void  free(void* ptr, std::size_t size_bytes, cudaStream_t stream);
//   void  release();                          // give cached memory back (after its cases)
// that throws std::exception on failure. It may also have
//   void  after_case(const std::string& case_text);  // called after each case
// which prints INFO lines of its own (ccalloc: the counters the case moved).
//
// Timing: host wall clock (steady_clock) around N pairs, then a
// cudaStreamSynchronize of the stream inside the timed region (so the
// stream-ordered allocators pay for any work they queued). Each case warms up
// first, runs `reps` repetitions and reports the median ns per pair, with the
// minimum and maximum. Output, one line per result, for bench/gpu/summarize.py:
//
//   RESULT allocator=ccalloc case=pair size=512 ns_per_pair=41.2 min_ns=40.9 max_ns=43.0 reps=7 pairs_per_rep=100000
//   RESULT allocator=ccalloc case=mixed live=64 ns_per_pair=98.1 ...
//   RESULT allocator=ccalloc case=threads threads=8 pairs_per_s=1.2e+07 min_pairs_per_s=... max_pairs_per_s=... windows=5 pairs=... seconds=1.0
//   RESULT allocator=ccalloc case=churn live=8 ns_per_pair=530.2 ...
//   RESULT allocator=ccalloc case=cross pairs_per_s=4.1e+06 pairs=200000 seconds=0.049
//   ERROR allocator=cub case=pair size=268435456 message="..."
#pragma once

#include "common/cases.hpp"
#include "hw_counters.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace ccalloc::bench {

inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(e) + " (" +
                             cudaGetErrorString(e) + ")");
}

/// Run settings; --quick shrinks every budget (smoke test).
struct settings {
  int reps = 7;                       ///< timed repetitions per case
  double rep_seconds = 0.02;          ///< target time of one repetition (pair case)
  std::size_t max_pairs_per_rep = 1u << 20;
  std::size_t mixed_steps_per_rep = 16384;
  double thread_seconds = 0.2;        ///< one measuring window of the threads case
  int thread_windows = 5;             ///< windows per thread count: the median is reported
  double warm_up_seconds = 0.5;       ///< host kept busy before the first case (warm_up_host)
  int mixed_repeats = 1;              ///< times the mixed case runs in a row, each reported
  bool quick = false;
  std::string only;                   ///< comma-separated allocator names; empty = all
  std::string cases;                  ///< comma-separated case names (pair,mixed,threads,churn,cross); empty = all

  static settings from_args(int argc, char** argv) {
    settings s;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--quick") {
        s.quick = true;
        s.reps = 3;
        s.rep_seconds = 0.002;
        s.mixed_steps_per_rep = 2048;
        s.thread_seconds = 0.05;
        s.thread_windows = 1;
      } else if (a.rfind("--thread-windows=", 0) == 0) {
        s.thread_windows = std::max(1, std::atoi(a.c_str() + 17));
      } else if (a.rfind("--only=", 0) == 0) {
        s.only = a.substr(7);
      } else if (a.rfind("--cases=", 0) == 0) {
        s.cases = a.substr(8);
      } else if (a.rfind("--thread-seconds=", 0) == 0) {
        s.thread_seconds = std::atof(a.c_str() + 17);
      } else if (a.rfind("--warm-up-seconds=", 0) == 0) {
        s.warm_up_seconds = std::max(0.0, std::atof(a.c_str() + 18));
      } else if (a.rfind("--mixed-repeats=", 0) == 0) {
        s.mixed_repeats = std::max(1, std::atoi(a.c_str() + 16));
      } else if (a.rfind("--reps=", 0) == 0) {
        s.reps = std::max(1, std::atoi(a.c_str() + 7));
      } else {
        std::fprintf(stderr,
                     "usage: %s [--quick] [--only=NAME,NAME] [--cases=pair,mixed,threads,churn,cross] [--reps=N] "
                     "[--thread-seconds=S] [--thread-windows=N] [--warm-up-seconds=S] [--mixed-repeats=N]\n",
                     argv[0]);
        std::exit(2);
      }
    }
    return s;
  }
  /// Whether allocator `name` runs (--only).
  [[nodiscard]] bool wants(const char* name) const { return listed(only, name); }
  /// Whether case `name` runs (--cases).
  [[nodiscard]] bool wants_case(const char* name) const { return listed(cases, name); }

 private:
  // Whether `name` is an item of the comma-separated `list`; an empty list holds everything.
  [[nodiscard]] static bool listed(const std::string& list, const char* name) {
    if (list.empty()) return true;
    std::size_t start = 0;
    for (;;) {
      const std::size_t end = list.find(',', start);
      if (list.substr(start, end == std::string::npos ? std::string::npos : end - start) == name) return true;
      if (end == std::string::npos) return false;
      start = end + 1;
    }
  }
};

/// Streams made up front: [0] for the single-stream cases, [i] for thread i.
struct stream_set {
  std::vector<cudaStream_t> streams;
  stream_set() {
    for (int i = 0; i < max_threads; ++i) {
      cudaStream_t s = nullptr;
      cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      streams.push_back(s);
    }
  }
  ~stream_set() {
    for (cudaStream_t s : streams) (void)cudaStreamDestroy(s);
  }
  stream_set(const stream_set&) = delete;
  stream_set& operator=(const stream_set&) = delete;
};

using bench_clock = std::chrono::steady_clock;

/// When the program started (static initialization): PERF lines say how
/// far into the run a case was.
inline const bench_clock::time_point program_start = bench_clock::now();

inline double seconds_since(bench_clock::time_point t0) {
  return std::chrono::duration<double>(bench_clock::now() - t0).count();
}

/// Keeps this thread busy for `seconds` before the first timed case, so that
/// the core has left any idle frequency state and the first allocator timed
/// is not at a disadvantage (the first case of a run measured up to a third
/// slower than the same case later in the run on the H200 host).
inline void warm_up_host(double seconds = 0.5) {
  const auto t0 = bench_clock::now();
  volatile std::uint64_t sink = 0;
  while (seconds_since(t0) < seconds)
    for (int i = 0; i < 1000; ++i) sink = sink + static_cast<std::uint64_t>(i);
}

struct rep_stats {
  double median_ns = 0, min_ns = 0, max_ns = 0;
};

inline rep_stats summarize_reps(std::vector<double> ns) {
  std::sort(ns.begin(), ns.end());
  rep_stats r;
  const std::size_t n = ns.size();
  r.median_ns = n % 2 ? ns[n / 2] : 0.5 * (ns[n / 2 - 1] + ns[n / 2]);
  r.min_ns = ns.front();
  r.max_ns = ns.back();
  return r;
}

/// Number of ERROR lines printed so far (a program exits 1 when it is not 0).
inline std::atomic<int> error_count{0};
[[nodiscard]] inline bool errors_printed() noexcept { return error_count.load() != 0; }

inline void print_error(const char* allocator, const std::string& case_text, const std::string& message) {
  error_count.fetch_add(1);
  std::string m = message;
  std::replace(m.begin(), m.end(), '"', '\'');
  std::replace(m.begin(), m.end(), '\n', ' ');
  std::printf("ERROR allocator=%s %s message=\"%s\"\n", allocator, case_text.c_str(), m.c_str());
  std::fflush(stdout);
}

/// `n` alloc+free pairs of `size_bytes` on `stream`, then a stream sync;
/// returns seconds.
template <class Alloc>
double time_pairs(Alloc& a, std::size_t size_bytes, cudaStream_t stream, std::size_t n) {
  const auto t0 = bench_clock::now();
  for (std::size_t i = 0; i < n; ++i) {
    void* p = a.alloc(size_bytes, stream);
    a.free(p, size_bytes, stream);
  }
  cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return seconds_since(t0);
}

/// Pair case: warm-up, calibration to settings::rep_seconds, `reps` reps.
template <class Alloc>
void run_pair(Alloc& a, std::size_t size_bytes, cudaStream_t stream, const settings& s) {
  constexpr std::size_t calib_pairs = 32;
  (void)time_pairs(a, size_bytes, stream, calib_pairs);  // warm-up: fills the cache
  const double per_pair = std::max(1e-9, time_pairs(a, size_bytes, stream, calib_pairs) / calib_pairs);
  // Slow cases (cudaMalloc/cudaFree of large sizes, ~150 us a pair) get a
  // quarter of the time: a few hundred pairs in all.
  const double target_s = per_pair > 10e-6 ? s.rep_seconds / 4 : s.rep_seconds;
  const auto n = static_cast<std::size_t>(
      std::clamp(target_s / per_pair, 16.0, static_cast<double>(s.max_pairs_per_rep)));
  std::vector<double> ns;
  for (int r = 0; r < s.reps; ++r)
    ns.push_back(time_pairs(a, size_bytes, stream, n) * 1e9 / static_cast<double>(n));
  const rep_stats st = summarize_reps(ns);
  std::printf("RESULT allocator=%s case=pair size=%zu ns_per_pair=%.1f min_ns=%.1f max_ns=%.1f reps=%d pairs_per_rep=%zu\n",
              Alloc::name, size_bytes, st.median_ns, st.min_ns, st.max_ns, s.reps, n);
  std::fflush(stdout);
}

/// A slot of the ring cases (mixed, churn): a live block.
struct ring_slot {
  void* ptr = nullptr;
  std::size_t size_bytes = 0;
};

/// A ring case: fills `slots` blocks of initial_size(i) bytes, runs
/// `warm_steps` steps and more until `min_warm_seconds` have passed (the
/// steady state of a program that has run a while: ccalloc's recycling time
/// budget looks at the last second, recycle_time_percent), then
/// settings::reps timed repetitions of `per_rep`
/// steps and prints RESULT with `label` ("case=mixed live=64"). Each step,
/// step(ring, free_slot, alloc_into), frees one slot and allocates into it.
/// Frees the ring at the end (also when a step throws).
template <class Alloc, class Initial, class Step>
void run_ring(Alloc& a, cudaStream_t stream, const settings& s, std::size_t slots, Initial initial_size, Step step,
              std::size_t warm_steps, double min_warm_seconds, std::size_t per_rep, const std::string& label) {
  std::vector<ring_slot> ring(slots);
  auto replace = [&](ring_slot& sl, std::size_t size_bytes) {
    a.free(sl.ptr, sl.size_bytes, stream);
    sl.ptr = nullptr;
    sl.ptr = a.alloc(size_bytes, stream);
    sl.size_bytes = size_bytes;
  };
  auto steps = [&](std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) step(ring, replace);
  };
  try {
    for (std::size_t i = 0; i < slots; ++i) {
      ring[i].ptr = a.alloc(initial_size(i), stream);
      ring[i].size_bytes = initial_size(i);
    }
    const auto warm_start = bench_clock::now();
    steps(warm_steps);
    while (seconds_since(warm_start) < min_warm_seconds) steps(per_rep);
    cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    std::vector<double> ns;
    hw_counters counters;
    const int cpu_before = current_cpu();
    for (int r = 0; r < s.reps; ++r) {
      const auto t0 = bench_clock::now();
      counters.start();
      steps(per_rep);
      counters.stop();
      cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      ns.push_back(seconds_since(t0) * 1e9 / static_cast<double>(per_rep));
    }
    const rep_stats st = summarize_reps(ns);
    std::printf("RESULT allocator=%s %s ns_per_pair=%.1f min_ns=%.1f max_ns=%.1f reps=%d pairs_per_rep=%zu\n",
                Alloc::name, label.c_str(), st.median_ns, st.min_ns, st.max_ns, s.reps, per_rep);
    // The CPU's counters per step over all reps (user space, this thread),
    // and the CPUs the thread ran on before and after.
    std::printf("PERF allocator=%s %s t=%.1fs cpu_before=%d cpu_after=%d %s\n", Alloc::name, label.c_str(),
                seconds_since(program_start), cpu_before, current_cpu(),
                counters.per(static_cast<double>(per_rep) * s.reps).c_str());
    std::fflush(stdout);
  } catch (...) {
    for (ring_slot& sl : ring)
      if (sl.ptr) try { a.free(sl.ptr, sl.size_bytes, stream); } catch (...) {}
    throw;
  }
  for (ring_slot& sl : ring) a.free(sl.ptr, sl.size_bytes, stream);
  cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

/// Mixed case: ring of mixed_slots live blocks; the same plan for everyone.
template <class Alloc>
void run_mixed(Alloc& a, cudaStream_t stream, const settings& s) {
  static const mixed_plan plan = make_mixed_plan();
  std::size_t pos = 0;
  auto step = [&](std::vector<ring_slot>& ring, auto& replace) {
    const mixed_step& st = plan.steps[pos];
    pos = pos + 1 == plan.steps.size() ? 0 : pos + 1;
    replace(ring[st.slot], st.size_bytes);
  };
  run_ring(a, stream, s, mixed_slots, [](std::size_t i) { return plan.initial_sizes_bytes[i]; }, step,
           s.quick ? s.mixed_steps_per_rep : plan.steps.size(),  // warm-up: one pass,
           s.quick ? 0.0 : 2.0,                                  // and two seconds
           s.mixed_steps_per_rep, "case=mixed live=" + std::to_string(mixed_slots));
}

/// One window of the threads case: `nthreads` threads, thread i on
/// streams[i], 1 MiB pairs for settings::thread_seconds; returns the pairs
/// of all threads together and the window's seconds.
template <class Alloc>
std::pair<std::uint64_t, double> threads_window(Alloc& a, int nthreads, const stream_set& ss, const settings& s) {
  struct alignas(64) counter {
    std::uint64_t pairs = 0;
  };
  std::vector<counter> counts(static_cast<std::size_t>(nthreads));
  std::atomic<int> ready{0};
  std::atomic<bool> go{false}, stop{false};
  std::mutex error_mutex;
  std::string error;
  std::vector<std::thread> threads;
  for (int t = 0; t < nthreads; ++t) {
    threads.emplace_back([&, t] {
      const cudaStream_t stream = ss.streams[static_cast<std::size_t>(t)];
      try {
        cuda_check(cudaSetDevice(0), "cudaSetDevice");
        (void)time_pairs(a, threads_pair_bytes, stream, 64);  // warm this stream's cache
      } catch (const std::exception& e) {
        std::lock_guard lock(error_mutex);
        error = e.what();
        stop = true;
      }
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      std::uint64_t done = 0;
      try {
        while (!stop.load(std::memory_order_relaxed)) {
          for (int i = 0; i < 64; ++i) {
            void* p = a.alloc(threads_pair_bytes, stream);
            a.free(p, threads_pair_bytes, stream);
          }
          done += 64;
        }
      } catch (const std::exception& e) {
        std::lock_guard lock(error_mutex);
        error = e.what();
        stop = true;
      }
      counts[static_cast<std::size_t>(t)].pairs = done;
    });
  }
  while (ready.load() < nthreads) std::this_thread::yield();
  const auto t0 = bench_clock::now();
  go.store(true, std::memory_order_release);
  std::this_thread::sleep_for(std::chrono::duration<double>(s.thread_seconds));
  stop = true;
  for (auto& th : threads) th.join();
  const double secs = seconds_since(t0);
  for (int t = 0; t < nthreads; ++t) (void)cudaStreamSynchronize(ss.streams[static_cast<std::size_t>(t)]);
  if (!error.empty()) throw std::runtime_error(error);
  std::uint64_t total = 0;
  for (const auto& c : counts) total += c.pairs;
  return {total, secs};
}

/// Threads case: settings::thread_windows windows (threads_window); reports
/// the median window's pairs/s of all threads together (as the other cases
/// report the median repetition: one window is at the mercy of the host's
/// scheduler), and the lowest and highest.
template <class Alloc>
void run_threads(Alloc& a, int nthreads, const stream_set& ss, const settings& s) {
  std::vector<double> rates;
  std::uint64_t pairs = 0;
  double seconds = 0.0;
  for (int w = 0; w < s.thread_windows; ++w) {
    const auto [n, secs] = threads_window(a, nthreads, ss, s);
    rates.push_back(static_cast<double>(n) / secs);
    pairs += n;
    seconds += secs;
  }
  std::sort(rates.begin(), rates.end());
  std::printf("RESULT allocator=%s case=threads threads=%d pairs_per_s=%.4g min_pairs_per_s=%.4g "
              "max_pairs_per_s=%.4g windows=%d pairs=%llu seconds=%.3f\n",
              Alloc::name, nthreads, rates[rates.size() / 2], rates.front(), rates.back(), s.thread_windows,
              static_cast<unsigned long long>(pairs), seconds);
  std::fflush(stdout);
}

/// Churn case: a ring of churn_slots live blocks, each step frees the oldest
/// and allocates the next size of make_churn_sizes(); time per step.
template <class Alloc>
void run_churn(Alloc& a, cudaStream_t stream, const settings& s) {
  static const std::vector<std::size_t> sizes = make_churn_sizes();
  std::size_t next = churn_slots;  // sizes[0 .. churn_slots) fill the ring
  std::size_t oldest = 0;
  auto step = [&](std::vector<ring_slot>& ring, auto& replace) {
    replace(ring[oldest], sizes[next]);
    oldest = oldest + 1 == churn_slots ? 0 : oldest + 1;
    next = next + 1 == sizes.size() ? churn_slots : next + 1;
  };
  const std::size_t per_rep = s.quick ? 256 : 2048;
  run_ring(a, stream, s, churn_slots, [](std::size_t i) { return sizes[i]; }, step, per_rep, 0.0, per_rep,
           "case=churn live=" + std::to_string(churn_slots));
}

/// Cross case: this thread allocates cross_pair_bytes on `stream` and hands
/// each pointer through a single-producer single-consumer ring to a second
/// thread, which frees it (on the same stream); pairs/s over `pairs` pairs.
template <class Alloc>
void run_cross(Alloc& a, cudaStream_t stream, const settings& s) {
  const std::size_t pairs = s.quick ? 20000 : 200000;
  std::array<std::atomic<void*>, cross_queue_depth> queue{};
  std::atomic<std::size_t> head{0};  // next slot the consumer reads
  std::size_t tail = 0;              // next slot the producer writes (producer only)
  std::atomic<bool> failed{false};
  std::string error;
  std::thread consumer([&] {
    try {
      cuda_check(cudaSetDevice(0), "cudaSetDevice");
      for (std::size_t i = 0; i < pairs; ++i) {
        const std::size_t k = i % cross_queue_depth;
        void* p = nullptr;
        while ((p = queue[k].load(std::memory_order_acquire)) == nullptr)
          if (failed.load(std::memory_order_relaxed)) return;
        queue[k].store(nullptr, std::memory_order_relaxed);
        head.store(i + 1, std::memory_order_release);
        a.free(p, cross_pair_bytes, stream);
      }
    } catch (const std::exception& e) {
      if (!failed.exchange(true)) error = e.what();
    }
  });
  const auto t0 = bench_clock::now();
  try {
    for (; tail < pairs && !failed.load(std::memory_order_relaxed); ++tail) {
      while (tail - head.load(std::memory_order_acquire) >= cross_queue_depth)
        if (failed.load(std::memory_order_relaxed)) break;
      void* p = a.alloc(cross_pair_bytes, stream);
      queue[tail % cross_queue_depth].store(p, std::memory_order_release);
    }
  } catch (const std::exception& e) {
    if (!failed.exchange(true)) error = e.what();
  }
  consumer.join();
  cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  const double secs = seconds_since(t0);
  if (failed.load()) throw std::runtime_error(error);
  std::printf("RESULT allocator=%s case=cross pairs_per_s=%.4g pairs=%zu seconds=%.3f\n", Alloc::name,
              static_cast<double>(pairs) / secs, pairs, secs);
  std::fflush(stdout);
}

/// Which cases an allocator runs.
struct case_set {
  bool pairs = true;
  bool mixed = true;
  bool threads = true;
  bool churn = true;
  bool cross = true;
};

/// Runs one case: ERROR on failure, then the adapter's after_case if it has one.
template <class Alloc, class Case>
void run_case(Alloc& a, const std::string& case_text, Case run) {
  try {
    run();
  } catch (const std::exception& e) {
    print_error(Alloc::name, case_text, e.what());
  }
  if constexpr (requires { a.after_case(case_text); }) a.after_case(case_text);
}

/// Runs `cases` for allocator `a`; a failing case prints ERROR and the rest go on.
template <class Alloc>
void run_all(Alloc& a, const stream_set& ss, const settings& s, case_set cases = {}) {
  const cudaStream_t stream = ss.streams[0];
  cases.pairs = cases.pairs && s.wants_case("pair");
  cases.mixed = cases.mixed && s.wants_case("mixed");
  cases.threads = cases.threads && s.wants_case("threads");
  cases.churn = cases.churn && s.wants_case("churn");
  cases.cross = cases.cross && s.wants_case("cross");
  if (cases.pairs)
    for (std::size_t size : pair_sizes_bytes)
      run_case(a, "case=pair size=" + std::to_string(size), [&] { run_pair(a, size, stream, s); });
  if (cases.mixed)
    for (int r = 0; r < s.mixed_repeats; ++r)
      run_case(a, "case=mixed live=" + std::to_string(mixed_slots), [&] { run_mixed(a, stream, s); });
  if (cases.threads)
    for (int n : thread_counts)
      run_case(a, "case=threads threads=" + std::to_string(n), [&] { run_threads(a, n, ss, s); });
  if (cases.churn)
    run_case(a, "case=churn live=" + std::to_string(churn_slots), [&] { run_churn(a, stream, s); });
  if (cases.cross) run_case(a, "case=cross", [&] { run_cross(a, stream, s); });
  try {
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    a.release();
  } catch (const std::exception& e) {
    print_error(Alloc::name, "case=release", e.what());
  }
}

/// One INFO line about the device and the runtime.
inline void print_device_info(const char* program) {
  cudaDeviceProp prop{};
  int runtime = 0, driver = 0;
  (void)cudaRuntimeGetVersion(&runtime);
  (void)cudaDriverGetVersion(&driver);
  cuda_check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("INFO program=%s device=\"%s\" cc=%d.%d memory_bytes=%zu cuda_runtime=%d cuda_driver=%d hw_threads=%u\n",
              program, prop.name, prop.major, prop.minor, prop.totalGlobalMem, runtime, driver,
              std::thread::hardware_concurrency());
  for (const char* var : {"CCALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"})
    if (const char* v = std::getenv(var)) std::printf("INFO env %s=\"%s\"\n", var, v);
  std::fflush(stdout);
}

}  // namespace ccalloc::bench
