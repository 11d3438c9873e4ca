// fault_injection_test.cpp (issue 9): a device call that fails at each point
// of a fixed workload. After every failure the allocator is consistent, the
// caller got a clear error, the allocator keeps working, and at the end every
// segment and event is back with the simulated device.
//
// The workload (run_workload) uses one 256 MiB simulated device, three
// allocation streams and two side streams: mixed sizes in both pools,
// record_stream with work queued on the side streams, frees whose events are
// still pending, clock advances, empty_cache, a memory fraction that forces a
// release and an out-of-memory ladder, and frees of everything.
//
// Fault kinds (fault_kinds(), one row each): how to make the k-th call of one
// device function fail, and what the caller must see then.
//   - segment_malloc returns nullptr once (the simulated device's own
//     fail_segment_malloc_after) or from the k-th call on;
//   - segment_malloc, segment_free, create_event, record_event,
//     synchronize_event throw backend_error (a CUDA error other than out of
//     memory);
//   - query_event throws (the simulated device's fail_event_query_after).
// A run first counts the calls the workload makes without faults (N), then
// for every k in 1..N replays it with the k-th call failing. Configurations
// (the second test parameter): defaults, PyTorch's exact reservations with
// oversize blocks and garbage collection, the lock released around the
// device malloc, no-caching mode.
//
// Expandable segments (issue 4): vm_create, vm_map and vm_unmap are counted
// and have "throws" rows, and configs() has expandable_segments:True; the rows
// are skipped while the workload makes no such call. Adding a fault kind
// (e.g. the simulated device's own "k-th map fails"): a row in fault_kinds()
// with the call it counts, its arm function and the error the caller must
// see; a new call to count goes in `call` and counting_backend.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace ccalloc;  // NOLINT: test file

// ---- a backend that counts calls and can make the k-th one throw ---------------

enum class call : std::size_t {
  segment_malloc,
  segment_free,
  create_event,
  record_event,
  query_event,
  synchronize_event,
  vm_create,  // expandable segments (SPEC B7)
  vm_map,
  vm_unmap,
  count_
};
constexpr std::array<const char*, static_cast<std::size_t>(call::count_)> call_names = {
    "segment_malloc", "segment_free", "create_event", "record_event", "query_event", "synchronize_event",
    "vm_create",      "vm_map",       "vm_unmap"};

/// Forwards to a sim_backend; counts the calls above and, when armed, makes
/// the k-th call of one of them throw backend_error("injected failure of NAME")
/// (a device error that is not out of memory), or makes every segment_malloc
/// from the k-th on return nullptr (the device stays out of memory).
class counting_backend final : public device_backend {
 public:
  explicit counting_backend(std::shared_ptr<sim_backend> sim) : sim_(std::move(sim)) {}

  std::shared_ptr<sim_backend> sim() const { return sim_; }
  std::uint64_t calls(call c) const { return counts_[static_cast<std::size_t>(c)]; }
  /// The k-th call of `c` from now throws (k >= 1).
  void throw_at(call c, std::uint64_t k) {
    throw_call_ = c;
    throw_at_ = calls(c) + k;
  }
  /// Every segment_malloc from the k-th from now returns nullptr.
  void out_of_memory_from(std::uint64_t k) { oom_from_ = calls(call::segment_malloc) + k; }
  void disarm() {
    throw_at_ = 0;
    oom_from_ = 0;
  }
  bool fired() const { return fired_; }

  std::string name() const override { return sim_->name(); }
  backend_capabilities capabilities() const override { return sim_->capabilities(); }
  int device_count() const override { return sim_->device_count(); }
  int current_device() const override { return sim_->current_device(); }
  void set_device(int device) override { sim_->set_device(device); }
  memory_info mem_get_info(int device) const override { return sim_->mem_get_info(device); }

  void* segment_malloc(int device, std::size_t size_bytes) override {
    const std::uint64_t n = count(call::segment_malloc);
    if (oom_from_ != 0 && n >= oom_from_) {
      fired_ = true;
      return nullptr;
    }
    return sim_->segment_malloc(device, size_bytes);
  }
  void segment_free(int device, void* ptr) override {
    count(call::segment_free);
    sim_->segment_free(device, ptr);
  }
  stream_t create_stream(int device) override { return sim_->create_stream(device); }
  void destroy_stream(int device, stream_t stream) override { sim_->destroy_stream(device, stream); }
  event_t create_event(int device) override {
    count(call::create_event);
    return sim_->create_event(device);
  }
  void destroy_event(int device, event_t event) override { sim_->destroy_event(device, event); }
  void record_event(int device, event_t event, stream_t stream) override {
    count(call::record_event);
    sim_->record_event(device, event, stream);
  }
  bool query_event(int device, event_t event) override {
    count(call::query_event);
    return sim_->query_event(device, event);
  }
  void synchronize_event(int device, event_t event) override {
    count(call::synchronize_event);
    sim_->synchronize_event(device, event);
  }
  void stream_wait_event(int device, stream_t stream, event_t event) override {
    sim_->stream_wait_event(device, stream, event);
  }
  void synchronize_stream(int device, stream_t stream) override { sim_->synchronize_stream(device, stream); }
  void synchronize_device(int device) override { sim_->synchronize_device(device); }

  // Virtual memory, peers and gates: forwarded (counted where a fault kind uses them).
  std::size_t vm_granularity(int device) const override { return sim_->vm_granularity(device); }
  void* vm_reserve(int device, std::size_t size_bytes) override { return sim_->vm_reserve(device, size_bytes); }
  void vm_release(int device, void* base, std::size_t size_bytes) override { sim_->vm_release(device, base, size_bytes); }
  bool vm_create(int device, std::size_t size_bytes, physical_handle_t* handle) override {
    count(call::vm_create);
    return sim_->vm_create(device, size_bytes, handle);
  }
  void vm_release_handle(int device, physical_handle_t handle) override { sim_->vm_release_handle(device, handle); }
  void vm_map(int device, void* addr, std::size_t size_bytes, physical_handle_t handle) override {
    count(call::vm_map);
    sim_->vm_map(device, addr, size_bytes, handle);
  }
  void vm_unmap(int device, void* addr, std::size_t size_bytes) override {
    count(call::vm_unmap);
    sim_->vm_unmap(device, addr, size_bytes);
  }
  void vm_set_access(int device, void* addr, std::size_t size_bytes, int peer) override {
    sim_->vm_set_access(device, addr, size_bytes, peer);
  }
  bool can_access_peer(int device, int peer) const override { return sim_->can_access_peer(device, peer); }
  void enable_peer_access(int device, int peer) override { sim_->enable_peer_access(device, peer); }
  gate_t create_gate(int device) override { return sim_->create_gate(device); }
  void wait_gate(int device, stream_t stream, gate_t gate) override { sim_->wait_gate(device, stream, gate); }
  void open_gate(int device, gate_t gate) override { sim_->open_gate(device, gate); }
  void destroy_gate(int device, gate_t gate) override { sim_->destroy_gate(device, gate); }

 private:
  // Counts a call of `c`; throws if it is the armed one.
  std::uint64_t count(call c) {
    const std::uint64_t n = ++counts_[static_cast<std::size_t>(c)];
    if (throw_at_ != 0 && c == throw_call_ && n == throw_at_) {
      fired_ = true;
      throw backend_error(std::string("injected failure of ") + call_names[static_cast<std::size_t>(c)]);
    }
    return n;
  }

  std::shared_ptr<sim_backend> sim_;
  std::array<std::uint64_t, static_cast<std::size_t>(call::count_)> counts_{};
  call throw_call_ = call::segment_malloc;
  std::uint64_t throw_at_ = 0;
  std::uint64_t oom_from_ = 0;
  bool fired_ = false;
};

// ---- the workload ------------------------------------------------------------------

constexpr std::size_t device_bytes = 256 * mib;

/// One operation's error, as the caller saw it.
struct op_error {
  std::string op;
  enum class type { out_of_memory, backend, other } kind;
  std::string message;
};

struct config_case {
  const char* name;
  const char* conf;
  bool caching;  // false: enable(false) first (no-caching mode)
};

/// Everything one run owns. Every operation goes through run(), which records
/// the error, if any, and then checks the allocator's invariants and that
/// allocation.all.current equals the pointers the workload holds.
class workload_run {
 public:
  explicit workload_run(const config_case& c) {
    backend_ = std::make_shared<counting_backend>(std::make_shared<sim_backend>(sim_options{1, device_bytes, 2 * mib}));
    alloc_ = std::make_unique<caching_allocator>(backend_, allocator_config::parse(c.conf));
    alloc_->init(1);
    if (!c.caching) alloc_->enable(false);
    sim_ = backend_->sim();
    s_ = {default_stream, sim_->create_stream(0), sim_->create_stream(0)};
    side_ = {sim_->create_stream(0), sim_->create_stream(0)};
  }

  counting_backend& backend() { return *backend_; }
  sim_backend& sim() { return *sim_; }
  const std::vector<op_error>& errors() const { return errors_; }
  const std::vector<std::string>& broken() const { return broken_; }

  // ---- operations --------------------------------------------------------------
  void malloc(std::size_t slot, std::size_t size, int stream) {
    run("malloc(" + std::to_string(size) + ")", [&] {
      void* p = alloc_->malloc(0, size, s_[static_cast<std::size_t>(stream)]);
      if (slots_.size() <= slot) slots_.resize(slot + 1, nullptr);
      if (slots_[slot] != nullptr) broken_.push_back("workload bug: slot reused");
      slots_[slot] = p;
    });
  }
  void free(std::size_t slot) {
    if (slot >= slots_.size() || slots_[slot] == nullptr) return;  // its malloc failed
    run("free", [&] {
      alloc_->free(slots_[slot]);
      slots_[slot] = nullptr;  // only once the free succeeded: else the pointer is still live
    });
  }
  void record(std::size_t slot, int side, std::uint64_t work_until) {
    if (slot >= slots_.size() || slots_[slot] == nullptr) return;
    const stream_t s = side_[static_cast<std::size_t>(side)];
    sim_->enqueue_work(0, s, work_until);
    run("record_stream", [&] { alloc_->record_stream(slots_[slot], s); });
  }
  void empty_cache() {
    run("empty_cache", [&] { alloc_->empty_cache(); });
  }
  void enable(bool on) {
    run(on ? "enable(true)" : "enable(false)", [&] { alloc_->enable(on); });
  }
  void set_fraction(double f) {
    run("set_memory_fraction", [&] { alloc_->set_memory_fraction(f, 0); });
  }
  void advance(std::uint64_t to) { sim_->advance_to(to); }

  /// After the faults: frees every pointer, lets all work complete, empties
  /// the cache; then the device must hold nothing of ours.
  void cleanup() {
    backend_->disarm();
    for (std::size_t i = 0; i < slots_.size(); ++i) free(i);
    sim_->advance_to(sim_->now() + 1000);
    empty_cache();
    const auto st = alloc_->get_device_stats(0);
    if (st.reserved_bytes[0].current != 0 || st.active_bytes[0].current != 0 || st.requested_bytes[0].current != 0)
      broken_.push_back("after cleanup: reserved " + std::to_string(st.reserved_bytes[0].current) + ", active " +
                        std::to_string(st.active_bytes[0].current) + ", requested " +
                        std::to_string(st.requested_bytes[0].current));
    if (sim_->counters().used_bytes != 0)
      broken_.push_back("after cleanup the device still holds " + std::to_string(sim_->counters().used_bytes) +
                        " bytes of segments");
    alloc_.reset();
    const auto c = sim_->counters();
    if (c.segment_mallocs != c.segment_frees)
      broken_.push_back("segments leaked: " + std::to_string(c.segment_mallocs) + " mallocs, " +
                        std::to_string(c.segment_frees) + " frees");
    if (c.live_events != 0) broken_.push_back(std::to_string(c.live_events) + " events leaked");
  }

 private:
  template <class F>
  void run(const std::string& op, F&& f) {
    try {
      f();
    } catch (const out_of_memory_error& e) {
      errors_.push_back({op, op_error::type::out_of_memory, e.what()});
    } catch (const backend_error& e) {
      errors_.push_back({op, op_error::type::backend, e.what()});
    } catch (const std::exception& e) {
      errors_.push_back({op, op_error::type::other, e.what()});
    }
    check(op);
  }

  void check(const std::string& op) {
    auto& dev = alloc_->device_allocator(0);
    try {
      dev.check_invariants();
    } catch (const std::exception& e) {
      broken_.push_back("after " + op + ": " + e.what());
    }
    std::int64_t held = 0;
    for (void* p : slots_) held += p != nullptr;
    const auto st = alloc_->get_device_stats(0);
    if (st.allocation[0].current != held)
      broken_.push_back("after " + op + ": allocation.all.current " + std::to_string(st.allocation[0].current) +
                        " but the caller holds " + std::to_string(held));
    for (void* p : slots_) {
      if (p == nullptr) continue;
      try {
        (void)alloc_->get_base_allocation(p);
      } catch (const std::exception& e) {
        broken_.push_back("after " + op + ": a pointer the caller holds is not live: " + e.what());
      }
    }
  }

  std::shared_ptr<counting_backend> backend_;
  std::shared_ptr<sim_backend> sim_;
  std::unique_ptr<caching_allocator> alloc_;
  std::array<stream_t, 3> s_{};
  std::array<stream_t, 2> side_{};
  std::vector<void*> slots_;
  std::vector<op_error> errors_;
  std::vector<std::string> broken_;
};

void run_workload(workload_run& w, const config_case& config) {
  // Both pools, three streams.
  const std::size_t sizes[] = {700, 3000, mib, 1536 * kib, 6 * mib, 12 * mib, 25 * mib, 100 * kib, 512, 3 * mib};
  for (std::size_t i = 0; i < std::size(sizes); ++i) w.malloc(i, sizes[i], static_cast<int>(i % 3));
  // Used on side streams; freed while that work is queued.
  const std::uint64_t t0 = w.sim().now();
  w.record(2, 0, t0 + 10);
  w.record(4, 1, t0 + 30);
  w.record(5, 0, t0 + 10);
  w.record(7, 1, t0 + 30);
  w.free(2);
  w.free(4);
  w.free(5);
  w.free(7);
  w.free(0);
  w.free(1);
  // Side stream 0's work completes, side stream 1's not: the next mallocs
  // query events and return some blocks.
  w.advance(t0 + 15);
  w.malloc(10, mib, 0);
  w.malloc(11, 6 * mib, 1);
  w.malloc(12, 2 * kib, 2);
  // empty_cache waits for side stream 1's events and returns what it can.
  w.empty_cache();
  w.malloc(13, 40 * mib, 2);
  w.malloc(14, 3 * mib, 2);
  w.record(13, 1, w.sim().now() + 50);
  w.free(13);
  // A cap below what is reserved releases the cache; a request above the
  // cap goes down the whole out-of-memory ladder (and waits for the pending
  // event of slot 13).
  w.set_fraction(0.5);
  w.malloc(15, 100 * mib, 0);
  w.malloc(16, 90 * mib, 1);
  w.set_fraction(1.0);
  // More pending frees, then mallocs that query them.
  const std::uint64_t t1 = w.sim().now();
  w.record(3, 0, t1 + 5);
  w.record(10, 1, t1 + 5);
  w.free(3);
  w.free(10);
  w.free(6);
  w.advance(t1 + 6);
  w.malloc(17, 12 * mib, 0);
  w.malloc(18, 700, 1);
  w.free(11);
  w.free(12);
  w.free(17);
  w.empty_cache();
  w.malloc(19, 20 * mib, 2);
  // Caching off (returns the cache) and on again, with pending frees.
  if (config.caching) {
    w.record(19, 0, w.sim().now() + 5);
    w.free(19);
    w.enable(false);
    w.malloc(20, 5 * mib, 0);
    w.free(20);
    w.enable(true);
  }
}

// ---- fault kinds ---------------------------------------------------------------------

struct fault_kind {
  std::string name;
  call counted;                                      // the call whose k-th instance fails
  std::function<void(workload_run&, std::uint64_t)> arm;
  // What the callers see: out_of_memory_error only, maybe none (the ladder
  // retries a failed segment malloc); at least one out_of_memory_error; or
  // exactly one backend_error whose message contains `message`. A segment
  // free that fails inside another operation in no-caching mode (a block
  // whose events completed) reaches no caller: the block stays cached and
  // the next empty_cache returns it (device_state::free_block).
  enum class expect { oom_or_nothing, oom_at_least_once, backend_once } expected;
  std::string message;
};

// The k-th call of `c` throws backend_error (counting_backend).
fault_kind throwing(call c) {
  const std::string name = call_names[static_cast<std::size_t>(c)];
  return {name + "_throws", c, [c](workload_run& w, std::uint64_t k) { w.backend().throw_at(c, k); },
          fault_kind::expect::backend_once, "injected failure of " + name};
}

const std::vector<fault_kind>& fault_kinds() {
  static const std::vector<fault_kind> kinds = {
      {"segment_malloc_null_once", call::segment_malloc,
       [](workload_run& w, std::uint64_t k) { w.sim().fail_segment_malloc_after(k); },
       fault_kind::expect::oom_or_nothing, ""},
      {"segment_malloc_null_from_k", call::segment_malloc,
       [](workload_run& w, std::uint64_t k) { w.backend().out_of_memory_from(k); },
       fault_kind::expect::oom_at_least_once, ""},
      throwing(call::segment_malloc),
      throwing(call::segment_free),
      throwing(call::create_event),
      throwing(call::record_event),
      {"query_event_throws", call::query_event,
       [](workload_run& w, std::uint64_t k) { w.sim().fail_event_query_after(k); },
       fault_kind::expect::backend_once, "sim: injected failure of query_event("},
      throwing(call::synchronize_event),
      // Expandable segments: these run once the allocator maps pages (the
      // "expandable" configuration); until then the workload makes no such
      // call and they are skipped. The simulated device's own "k-th map
      // fails" (SPEC: fault injection of a map) becomes one more row like
      // segment_malloc_null_once.
      throwing(call::vm_create),
      throwing(call::vm_map),
      throwing(call::vm_unmap),
  };
  return kinds;
}

const std::vector<config_case>& configs() {
  static const std::vector<config_case> cases = {
      {"defaults", "", true},
      {"pytorch_exact_oversize_gc",
       "trim_on_new_peak:False,max_split_size_mb:24,garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
       true},
      {"release_lock", "release_lock_on_cudamalloc:True,roundup_power2_divisions:4", true},
      {"no_caching", "", false},
      {"expandable", "expandable_segments:True", true},
  };
  return cases;
}

// The out-of-memory message names the device and the size asked for.
std::string check_oom_message(const op_error& e) {
  if (e.message.find("out of memory on device 0") == std::string::npos ||
      e.message.find("Tried to allocate") == std::string::npos || e.message.find(" bytes;") == std::string::npos)
    return "unclear out-of-memory message from " + e.op + ": " + e.message;
  return {};
}

class FaultInjectionTest : public ::testing::TestWithParam<std::tuple<std::size_t, std::size_t>> {};

TEST_P(FaultInjectionTest, EveryCallOfTheWorkloadMayFail) {
  const fault_kind& kind = fault_kinds()[std::get<0>(GetParam())];
  const config_case& config = configs()[std::get<1>(GetParam())];

  // The workload without faults: the calls it makes, and its own OOMs (the
  // fraction step provokes one on purpose).
  std::uint64_t calls = 0;
  std::uint64_t clean_failed_mallocs = 0;
  std::size_t clean_errors = 0;
  {
    workload_run clean(config);
    run_workload(clean, config);
    calls = clean.backend().calls(kind.counted);
    clean_failed_mallocs = clean.sim().counters().failed_mallocs;
    clean_errors = clean.errors().size();
    for (const auto& e : clean.errors())
      ASSERT_EQ(e.kind, op_error::type::out_of_memory) << "without faults: " << e.op << ": " << e.message;
    clean.cleanup();
    for (const auto& b : clean.broken()) ADD_FAILURE() << "without faults: " << b;
  }
  if (calls == 0) GTEST_SKIP() << "this configuration's workload makes no " << call_names[static_cast<std::size_t>(kind.counted)] << " call";

  std::size_t errors_seen = 0;
  for (std::uint64_t k = 1; k <= calls; ++k) {
    SCOPED_TRACE(kind.name + " at call " + std::to_string(k) + " of " + std::to_string(calls) +
                 ", config " + config.name);
    workload_run w(config);
    kind.arm(w, k);
    run_workload(w, config);
    const bool fired = w.backend().fired() || w.sim().counters().failed_mallocs > clean_failed_mallocs ||
                       (kind.counted == call::query_event &&
                        std::any_of(w.errors().begin(), w.errors().end(), [](const op_error& e) {
                          return e.message.find("injected failure of query_event") != std::string::npos;
                        }));
    EXPECT_TRUE(fired) << "the fault never happened";

    std::size_t backend_errors = 0, ooms = 0;
    for (const auto& e : w.errors()) {
      switch (e.kind) {
        case op_error::type::out_of_memory: {
          ++ooms;
          const std::string problem = check_oom_message(e);
          EXPECT_TRUE(problem.empty()) << problem;
          break;
        }
        case op_error::type::backend:
          ++backend_errors;
          EXPECT_NE(e.message.find(kind.message), std::string::npos)
              << e.op << " failed with an unexpected backend_error: " << e.message;
          break;
        case op_error::type::other:
          ADD_FAILURE() << e.op << " failed with an exception that is not a ccalloc error type: " << e.message;
          break;
      }
    }
    switch (kind.expected) {
      case fault_kind::expect::oom_or_nothing:
        EXPECT_EQ(backend_errors, 0u);
        break;
      case fault_kind::expect::oom_at_least_once:
        EXPECT_EQ(backend_errors, 0u);
        EXPECT_GT(ooms, 0u) << "the device stayed out of memory, yet no caller heard of it";
        break;
      case fault_kind::expect::backend_once:
        if (kind.counted == call::segment_free && !config.caching && backend_errors == 0) break;  // see fault_kind
        EXPECT_EQ(backend_errors, 1u) << "the injected failure should reach exactly one caller";
        break;
    }
    w.cleanup();
    for (const auto& b : w.broken()) ADD_FAILURE() << b;
    if (::testing::Test::HasFailure()) break;  // one failing k is enough to read
    errors_seen += w.errors().size();
  }
  std::printf("%s, config %s: each of %llu calls failed in turn; %zu errors reached callers (%zu per run "
              "without faults)\n",
              kind.name.c_str(), config.name, static_cast<unsigned long long>(calls), errors_seen, clean_errors);
}

// ---- regressions found by the matrix above ----------------------------------------

// No-caching mode: a free whose segment_free failed had already put the block
// back in the pool; the front end then kept the pointer live, so the block was
// both free and allocated (negative allocation counts, a double delete later).
TEST(FaultRegression, NoCachingFreeThatTheDeviceRefusesChangesNothing) {
  auto backend = std::make_shared<counting_backend>(std::make_shared<sim_backend>(sim_options{1, device_bytes, 2 * mib}));
  caching_allocator alloc(backend, allocator_config{});
  alloc.init(1);
  alloc.enable(false);
  void* p = alloc.malloc(0, 5 * mib, 0);
  const auto before = alloc.get_device_stats(0);
  backend->throw_at(call::segment_free, 1);
  try {
    alloc.free(p);
    FAIL() << "the injected failure was not reported";
  } catch (const backend_error& e) {
    EXPECT_NE(std::string(e.what()).find("injected failure of segment_free"), std::string::npos) << e.what();
  }
  const auto after = alloc.get_device_stats(0);
  EXPECT_EQ(after.allocation[0].current, 1);
  EXPECT_EQ(after.allocated_bytes[0].current, before.allocated_bytes[0].current);
  EXPECT_EQ(after.reserved_bytes[0].current, before.reserved_bytes[0].current);
  EXPECT_EQ(alloc.get_base_allocation(p).first, p);  // still live
  alloc.device_allocator(0).check_invariants();
  alloc.free(p);  // the device takes it now
  EXPECT_EQ(alloc.get_device_stats(0).reserved_bytes[0].current, 0);
  EXPECT_EQ(backend->sim()->counters().used_bytes, 0u);
}

// set_memory_fraction set the new cap, then failed while returning the cache:
// the caller got an error, yet the cap had changed.
TEST(FaultRegression, MemoryFractionIsUnchangedWhenReturningTheCacheFails) {
  auto backend = std::make_shared<counting_backend>(std::make_shared<sim_backend>(sim_options{1, device_bytes, 2 * mib}));
  caching_allocator alloc(backend, allocator_config{});
  alloc.init(1);
  const stream_t side = backend->sim()->create_stream(0);
  void* p = alloc.malloc(0, 100 * mib, 0);
  backend->sim()->enqueue_work(0, side, 10);
  alloc.record_stream(p, side);
  alloc.free(p);  // pending on `side`: returning the cache synchronizes its event
  backend->throw_at(call::synchronize_event, 1);
  EXPECT_THROW(alloc.set_memory_fraction(0.25, 0), backend_error);
  EXPECT_EQ(alloc.get_memory_fraction(0), 1.0);
  alloc.device_allocator(0).check_invariants();
  alloc.set_memory_fraction(0.25, 0);
  EXPECT_EQ(alloc.get_memory_fraction(0), 0.25);
  EXPECT_EQ(alloc.get_device_stats(0).reserved_bytes[0].current, 0);
}

// enable(false) switched devices one by one; a device that failed to return
// its cache left the devices before it in no-caching mode and the allocator
// saying caching was off.
TEST(FaultRegression, DisablingCachingIsAllOrNothingAcrossDevices) {
  auto sim = std::make_shared<sim_backend>(sim_options{2, device_bytes, 2 * mib});
  auto backend = std::make_shared<counting_backend>(sim);
  caching_allocator alloc(backend, allocator_config::parse("expandable_segments:False"));  // cudaFree'd segments
  alloc.init(2);
  alloc.free(alloc.malloc(0, 3 * mib, 0));  // a cached segment on each device
  alloc.free(alloc.malloc(1, 3 * mib, 0));
  backend->throw_at(call::segment_free, 2);  // device 0 returns its cache, device 1 fails
  EXPECT_THROW(alloc.enable(false), backend_error);
  EXPECT_TRUE(alloc.is_enabled());
  EXPECT_TRUE(alloc.device_allocator(0).caching_enabled());
  EXPECT_TRUE(alloc.device_allocator(1).caching_enabled());
  alloc.enable(false);
  EXPECT_FALSE(alloc.device_allocator(0).caching_enabled());
  EXPECT_FALSE(alloc.device_allocator(1).caching_enabled());
  EXPECT_EQ(sim->counters().used_bytes, 0u);
}

// Every (fault kind, configuration), except that the virtual-memory calls
// are tried only where expandable segments are on.
std::vector<std::tuple<std::size_t, std::size_t>> fault_cases() {
  std::vector<std::tuple<std::size_t, std::size_t>> out;
  for (std::size_t k = 0; k < fault_kinds().size(); ++k) {
    const call c = fault_kinds()[k].counted;
    const bool virtual_memory = c == call::vm_create || c == call::vm_map || c == call::vm_unmap;
    for (std::size_t i = 0; i < configs().size(); ++i)
      if (!virtual_memory || std::string(configs()[i].conf).find("expandable_segments:True") != std::string::npos)
        out.emplace_back(k, i);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(
    Faults, FaultInjectionTest, ::testing::ValuesIn(fault_cases()),
    [](const ::testing::TestParamInfo<std::tuple<std::size_t, std::size_t>>& param_info) {
      return fault_kinds()[std::get<0>(param_info.param)].name + "__" +
             configs()[std::get<1>(param_info.param)].name;
    });

}  // namespace
