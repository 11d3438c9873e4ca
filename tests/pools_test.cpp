// Private pools (SPEC F20-F23), checkpoints (F24) and CUDA graph capture
// semantics (issue 6) on the simulated device, with plain and with
// expandable segments. The sim fails event queries, waits and frees while a
// stream captures (as CUDA's global capture mode does), so a test that
// captures also checks that the allocator makes none of those calls.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/device_caching_allocator.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace ccalloc;  // NOLINT: test file

constexpr std::size_t MiB = mib;
constexpr std::size_t KiB = kib;
std::uintptr_t U(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

const mempool_id_t P{1, 0};
const mempool_id_t Q{0, 7};
// Two streams of the simulated device (any handle is one, except 1 and 2:
// cudaStreamLegacy's and cudaStreamPerThread's values).
constexpr stream_t S1 = 11;
constexpr stream_t S2 = 12;
constexpr stream_t S3 = 13;

/// Makes S1, S2 and S3 streams of device 0 of `sim` (it rejects handles it did not make).
void adopt_test_streams(sim_backend& sim) {
  for (const stream_t s : {S1, S2, S3}) sim.adopt_stream(0, s);
}

// Runs each test with expandable segments (the default) and with plain ones.
class PoolsTest : public ::testing::TestWithParam<bool> {
 protected:
  void make(std::size_t capacity = 256 * MiB, int devices = 1) {
    alloc.reset();
    sim_options o;
    o.capacity_bytes = capacity;
    o.device_count = devices;
    sim = std::make_shared<sim_backend>(o);
    adopt_test_streams(*sim);
    alloc = std::make_unique<caching_allocator>(
        sim, allocator_config::parse(GetParam() ? "expandable_segments:True" : "expandable_segments:False"));
    alloc->init(devices);
  }
  void SetUp() override { make(); }
  void TearDown() override {
    if (alloc)
      for (int d = 0; d < sim->device_count(); ++d) alloc->device_allocator(d).check_invariants();
  }
  device_caching_allocator& dev(int d = 0) { return alloc->device_allocator(d); }
  void* m(std::size_t bytes, stream_t s = 0, int d = 0) { return alloc->malloc(d, bytes, s); }
  std::int64_t reserved() { return alloc->get_device_stats(0).reserved_bytes[0].current; }
  // The pool of the segment holding `p`.
  mempool_id_t pool_of(const void* p) {
    for (const segment_info& s : dev().segments())
      if (U(p) >= s.address && U(p) < s.address + s.total_bytes) return s.pool;
    ADD_FAILURE() << "no segment holds " << U(p);
    return {};
  }
  block_state state_of(const void* p) {
    for (const segment_info& s : dev().segments())
      for (const block_info& b : s.blocks)
        if (b.address == U(p)) return b.state;
    ADD_FAILURE() << "no block at " << U(p);
    return block_state::inactive;
  }
  static stream_filter only(stream_t s) {
    return [s](stream_t x) { return x == s; };
  }
  template <class F>
  static std::string error_of(F f) {
    try {
      f();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(no error)";
  }

  std::shared_ptr<sim_backend> sim;
  std::unique_ptr<caching_allocator> alloc;
};

INSTANTIATE_TEST_SUITE_P(Segments, PoolsTest, ::testing::Values(true, false),
                         [](const auto& param_info) { return param_info.param ? std::string("Expandable") : std::string("Plain"); });

// ---- F20: create, incref, release --------------------------------------------------

TEST_P(PoolsTest, UseCountsAndDeletionWhenEmpty) {
  EXPECT_EQ(alloc->get_pool_use_count(0, P), 0) << "unknown pool";
  alloc->create_or_incref_pool(0, P);
  EXPECT_EQ(alloc->get_pool_use_count(0, P), 1);
  alloc->create_or_incref_pool(0, P);
  EXPECT_EQ(alloc->get_pool_use_count(0, P), 2);
  alloc->release_pool(0, P);
  EXPECT_EQ(alloc->get_pool_use_count(0, P), 1);
  alloc->release_pool(0, P);
  EXPECT_EQ(alloc->get_pool_use_count(0, P), 0);
  EXPECT_TRUE(dev().pools().empty()) << "a pool without users and segments is deleted at once";
  const std::string e = error_of([&] { alloc->release_pool(0, P); });
  EXPECT_NE(e.find("has no private pool (1, 0)"), std::string::npos) << e;
}

TEST_P(PoolsTest, ReleasingTwiceWhileItHoldsSegmentsIsAnError) {
  alloc->create_or_incref_pool(0, P);
  alloc->begin_allocate_to_pool(0, P, only(S1));
  void* a = m(4 * KiB, S1);
  alloc->end_allocate_to_pool(0, P);
  alloc->release_pool(0, P);
  EXPECT_EQ(dev().pools().size(), 1u) << "kept: it holds a segment";
  const std::string e = error_of([&] { alloc->release_pool(0, P); });
  EXPECT_NE(e.find("already released (use count 0)"), std::string::npos) << e;
  EXPECT_EQ(alloc->get_pool_use_count(0, P), 0);
  alloc->free(a);
  alloc->empty_cache();
  EXPECT_TRUE(dev().pools().empty()) << "emptyCache returned its segment, then it was deleted";
  EXPECT_EQ(reserved(), 0);
}

TEST_P(PoolsTest, BadIdsAndHalfCustomAllocatorsAreRejected) {
  std::string e = error_of([&] { alloc->create_or_incref_pool(0, mempool_id_t{}); });
  EXPECT_NE(e.find("(0, 0) names the default pool"), std::string::npos) << e;
  segment_allocator half;
  half.malloc = [](std::size_t) -> void* { return nullptr; };
  e = error_of([&] { alloc->create_or_incref_pool(0, P, half); });
  EXPECT_NE(e.find("has only its malloc function"), std::string::npos) << e;
  EXPECT_TRUE(dev().pools().empty());
  e = error_of([&] { alloc->create_or_incref_pool(3, P); });
  EXPECT_NE(e.find("device 3"), std::string::npos) << e;
}

// ---- F21: begin/end allocate to pool ------------------------------------------------

TEST_P(PoolsTest, AllocationsOnFilteredStreamsGoToThePool) {
  alloc->create_or_incref_pool(0, P);
  alloc->begin_allocate_to_pool(0, P, only(S1));
  void* a = m(3 * MiB, S1);
  void* b = m(3 * MiB, S2);
  EXPECT_EQ(pool_of(a), P);
  EXPECT_EQ(pool_of(b), mempool_id_t{});
  alloc->end_allocate_to_pool(0, P);
  void* c = m(3 * MiB, S1);
  EXPECT_EQ(pool_of(c), mempool_id_t{}) << "after end: the default pool";
  const pool_usage u = alloc->get_pool_stats(0, P);
  EXPECT_EQ(u.allocated_bytes, 3 * MiB);
  EXPECT_EQ(u.allocation_count, 1u);
  EXPECT_EQ(u.use_count, 1);
  EXPECT_GE(u.reserved_bytes, 3 * MiB);
  EXPECT_EQ(alloc->get_pool_stats(0, {}).allocated_bytes, 6 * MiB) << "the default pool holds b and c";

  // A block of the pool returns to it: the default pool never reuses it.
  alloc->free(a);
  void* d = m(3 * MiB, S1);
  EXPECT_NE(U(d), U(a));
  EXPECT_EQ(pool_of(d), mempool_id_t{});
  alloc->begin_allocate_to_pool(0, P, only(S1));
  void* e = m(3 * MiB, S1);
  alloc->end_allocate_to_pool(0, P);
  EXPECT_EQ(U(e), U(a)) << "the pool's cached block is reused inside the pool";
  for (void* p : {b, c, d, e}) alloc->free(p);
  alloc->release_pool(0, P);
}

TEST_P(PoolsTest, NestedBeginsTheNewestMatchingWins) {
  alloc->create_or_incref_pool(0, P);
  alloc->create_or_incref_pool(0, Q);
  alloc->begin_allocate_to_pool(0, P, [](stream_t) { return true; });
  alloc->begin_allocate_to_pool(0, Q, only(S2));
  void* a = m(64 * KiB, S1);
  void* b = m(64 * KiB, S2);
  EXPECT_EQ(pool_of(a), P);
  EXPECT_EQ(pool_of(b), Q);
  alloc->end_allocate_to_pool(0, Q);
  void* c = m(64 * KiB, S2);
  EXPECT_EQ(pool_of(c), P);
  alloc->end_allocate_to_pool(0, P);
  EXPECT_TRUE(alloc->check_pool_live_allocations(0, P, {a, c}));
  EXPECT_TRUE(alloc->check_pool_live_allocations(0, Q, {b}));
  for (void* p : {a, b, c}) alloc->free(p);
}

TEST_P(PoolsTest, EndingAPoolThatIsNotActiveIsAnErrorAndChangesNothing) {
  alloc->create_or_incref_pool(0, P);
  std::string e = error_of([&] { alloc->end_allocate_to_pool(0, P); });
  EXPECT_NE(e.find("(1, 0) of device 0 is not active"), std::string::npos) << e;
  alloc->begin_allocate_to_pool(0, P, only(S1));
  alloc->end_allocate_to_pool(0, P);
  e = error_of([&] { alloc->end_allocate_to_pool(0, P); });
  EXPECT_NE(e.find("is not active"), std::string::npos) << e << " (ended twice)";
  e = error_of([&] { alloc->begin_allocate_to_pool(0, Q, only(S1)); });
  EXPECT_NE(e.find("has no private pool (0, 7)"), std::string::npos) << e;
  e = error_of([&] { alloc->begin_allocate_to_pool(0, P, nullptr); });
  EXPECT_NE(e.find("filter is empty"), std::string::npos) << e;
  void* a = m(4 * KiB, S1);
  EXPECT_EQ(pool_of(a), mempool_id_t{}) << "no begin is active";
  alloc->free(a);
}

TEST_P(PoolsTest, AllocatingToAReleasedPoolIsAnError) {
  alloc->create_or_incref_pool(0, P);
  alloc->begin_allocate_to_pool(0, P, only(S1));
  void* a = m(4 * KiB, S1);
  alloc->release_pool(0, P);
  const auto before = alloc->get_device_stats(0);
  const std::string e = error_of([&] { (void)m(4 * KiB, S1); });
  EXPECT_NE(e.find("private pool (1, 0) of device 0, which was released"), std::string::npos) << e;
  EXPECT_EQ(alloc->get_device_stats(0).allocation[0].current, before.allocation[0].current);
  alloc->end_allocate_to_pool(0, P);
  const std::string e2 = error_of([&] { alloc->begin_allocate_to_pool(0, P, only(S1)); });
  EXPECT_NE(e2.find("was released (use count 0)"), std::string::npos) << e2;
  alloc->free(a);
  alloc->empty_cache();
  EXPECT_TRUE(dev().pools().empty());
}

// ---- segments of live pools stay; dead pools are released ------------------------------

TEST_P(PoolsTest, EmptyCacheKeepsUsedPoolsAndReleasesDeadOnes) {
  alloc->create_or_incref_pool(0, P);
  alloc->begin_allocate_to_pool(0, P, only(S1));
  void* a = m(5 * MiB, S1);
  void* b = m(100 * KiB, S1);
  alloc->end_allocate_to_pool(0, P);
  alloc->free(a);
  alloc->free(b);
  const auto held = alloc->get_pool_stats(0, P).reserved_bytes;
  EXPECT_GT(held, 0u);
  alloc->empty_cache();
  EXPECT_EQ(alloc->get_pool_stats(0, P).reserved_bytes, held) << "a graph may still use these addresses";
  EXPECT_EQ(static_cast<std::size_t>(reserved()), held);
  alloc->release_pool(0, P);
  alloc->empty_cache();
  EXPECT_EQ(reserved(), 0);
  EXPECT_TRUE(dev().pools().empty());
}

// Dead pools give their cached segments back in the order of their ids,
// not of where the host heap put the pools: the pool made first (the
// higher id here) goes back last. Plain segments (segment_free events).
TEST(PoolsOrder, DeadPoolsGoBackInTheOrderOfTheirIds) {
  sim_options o;
  o.capacity_bytes = 256 * MiB;
  auto sim = std::make_shared<sim_backend>(o);
  adopt_test_streams(*sim);
  caching_allocator alloc(sim, allocator_config::parse("expandable_segments:False"));
  alloc.init(1);
  const mempool_id_t made_first{1, 9}, made_second{1, 2};
  std::vector<void*> blocks;
  for (const mempool_id_t id : {made_first, made_second}) {
    alloc.create_or_incref_pool(0, id);
    alloc.begin_allocate_to_pool(0, id, [](stream_t s) { return s == S1; });
    blocks.push_back(alloc.malloc(0, 3 * MiB, S1));
    alloc.end_allocate_to_pool(0, id);
  }
  for (void* b : blocks) alloc.free(b);
  for (const mempool_id_t id : {made_first, made_second}) alloc.release_pool(0, id);
  std::vector<std::uintptr_t> freed;
  alloc.attach_allocator_trace_tracker([&](const trace_entry& e) {
    if (e.action == trace_entry_action::segment_free) freed.push_back(e.addr);
  });
  history_options h;
  h.enabled = true;
  h.when = record_context::never;
  alloc.record_history(h);
  alloc.empty_cache();
  EXPECT_EQ(freed, (std::vector<std::uintptr_t>{U(blocks[1]), U(blocks[0])})) << "pool (1, 2) first, then (1, 9)";
  EXPECT_TRUE(alloc.device_allocator(0).pools().empty());
}

TEST_P(PoolsTest, TheOutOfMemoryPathReleasesDeadPools) {
  make(64 * MiB);
  alloc->create_or_incref_pool(0, P);
  alloc->begin_allocate_to_pool(0, P, only(S1));
  void* a = m(40 * MiB, S1);
  alloc->end_allocate_to_pool(0, P);
  alloc->free(a);
  EXPECT_THROW((void)m(60 * MiB, S1), out_of_memory_error) << "the live pool keeps its 40 MiB";
  alloc->release_pool(0, P);
  void* b = m(60 * MiB, S1);
  EXPECT_EQ(pool_of(b), mempool_id_t{});
  std::size_t in_p = 0;
  for (const segment_info& s : dev().segments())
    if (s.pool == P) in_p += s.mapped_bytes;
  EXPECT_LE(in_p + 60 * MiB, 64 * MiB) << "the dead pool's memory went back (expandable: as much as needed)";
  if (!GetParam()) {
    EXPECT_EQ(in_p, 0u);
  }
  alloc->free(b);
  alloc->empty_cache();
  EXPECT_TRUE(dev().pools().empty()) << "and then the pool";
}

// ---- F22: use on OOM, no split ----------------------------------------------------------

TEST_P(PoolsTest, UseOnOomLendsFreeBlocksToTheDefaultPool) {
  make(64 * MiB);
  alloc->create_or_incref_pool(0, P);
  alloc->begin_allocate_to_pool(0, P, only(S1));
  void* a = m(40 * MiB, S1);
  alloc->end_allocate_to_pool(0, P);
  alloc->free(a);
  EXPECT_THROW((void)m(30 * MiB, S1), out_of_memory_error);
  alloc->set_use_on_oom(0, P);
  void* b = m(30 * MiB, S1);
  EXPECT_EQ(pool_of(b), P) << "borrowed from the pool, and stays in it";
  EXPECT_TRUE(alloc->check_pool_live_allocations(0, P, {b}));
  EXPECT_THROW((void)m(30 * MiB, S2), out_of_memory_error) << "blocks stay bound to their stream";
  alloc->free(b);
  EXPECT_EQ(alloc->get_pool_stats(0, P).allocated_bytes, 0u);
  EXPECT_EQ(alloc->get_pool_stats(0, P).reserved_bytes, static_cast<std::size_t>(reserved()));
  const std::string e = error_of([&] { alloc->set_use_on_oom(0, Q); });
  EXPECT_NE(e.find("set_use_on_oom: device 0 has no private pool (0, 7)"), std::string::npos) << e;
}

TEST_P(PoolsTest, NoSplitPoolsHandOutWholeBlocks) {
  alloc->create_or_incref_pool(0, P);
  alloc->set_no_split(0, P);
  alloc->begin_allocate_to_pool(0, P, only(S1));
  void* a = m(4 * KiB, S1);
  void* b = m(4 * KiB, S1);
  alloc->end_allocate_to_pool(0, P);
  EXPECT_EQ(alloc->get_pool_stats(0, P).allocated_bytes, 4 * MiB) << "two whole 2 MiB blocks";
  EXPECT_GE(std::max(U(a), U(b)) - std::min(U(a), U(b)), 2 * MiB);
  void* c = m(4 * KiB, S1);
  void* d = m(4 * KiB, S1);
  EXPECT_EQ(U(d), U(c) + 4 * KiB) << "the default pool still splits";
  for (void* p : {a, b, c, d}) alloc->free(p);
  const std::string e = error_of([&] { alloc->set_no_split(0, Q); });
  EXPECT_NE(e.find("set_no_split"), std::string::npos) << e;
}

// ---- F23 and per-pool attribution ----------------------------------------------------------

TEST_P(PoolsTest, LiveAllocationChecks) {
  alloc->create_or_incref_pool(0, P);
  EXPECT_TRUE(alloc->check_pool_live_allocations(0, P, {}));
  alloc->begin_allocate_to_pool(0, P, only(S1));
  void* a = m(4 * KiB, S1);
  void* b = m(2 * MiB, S1);
  alloc->end_allocate_to_pool(0, P);
  void* c = m(4 * KiB, S1);
  EXPECT_TRUE(alloc->check_pool_live_allocations(0, P, {b, a}));
  EXPECT_TRUE(alloc->check_pool_live_allocations(0, P, {a, b, a})) << "duplicates ignored";
  EXPECT_FALSE(alloc->check_pool_live_allocations(0, P, {a}));
  EXPECT_FALSE(alloc->check_pool_live_allocations(0, P, {a, b, c})) << "c is in the default pool";
  alloc->free(a);
  EXPECT_TRUE(alloc->check_pool_live_allocations(0, P, {b}));
  EXPECT_FALSE(alloc->check_pool_live_allocations(0, Q, {b})) << "an unknown pool has none";
  alloc->free(b);
  alloc->free(c);
}

TEST_P(PoolsTest, SegmentsAndStatsAttributeMemoryToItsPool) {
  alloc->create_or_incref_pool(0, P);
  alloc->create_or_incref_pool(0, Q);
  alloc->begin_allocate_to_pool(0, P, only(S1));
  void* a = m(6 * MiB, S1);
  alloc->end_allocate_to_pool(0, P);
  alloc->begin_allocate_to_pool(0, Q, only(S1));
  void* b = m(1 * MiB, S1);
  alloc->end_allocate_to_pool(0, Q);
  void* c = m(3 * MiB, S1);
  std::size_t sum = 0;
  for (mempool_id_t id : {mempool_id_t{}, P, Q}) sum += alloc->get_pool_stats(0, id).reserved_bytes;
  EXPECT_EQ(sum, static_cast<std::size_t>(reserved())) << "every reserved byte belongs to one pool";
  EXPECT_EQ(alloc->get_pool_stats(0, P).allocated_bytes, 6 * MiB);
  EXPECT_EQ(alloc->get_pool_stats(0, Q).allocated_bytes, 1 * MiB);
  EXPECT_EQ(alloc->get_pool_stats(0, {}).allocated_bytes, 3 * MiB);
  std::size_t in_p = 0;
  for (const segment_info& s : dev().segments())
    if (s.pool == P) in_p += s.allocated_bytes;
  EXPECT_EQ(in_p, 6 * MiB);
  for (void* p : {a, b, c}) alloc->free(p);
  EXPECT_THROW((void)alloc->get_pool_stats(0, {5, 5}), invalid_argument_error);
}

// ---- custom segment allocator ---------------------------------------------------------------

TEST_P(PoolsTest, CustomSegmentAllocatorSuppliesThePoolsSegments) {
  int mallocs = 0, frees = 0;
  segment_allocator custom;
  custom.malloc = [&](std::size_t n) {
    ++mallocs;
    return sim->segment_malloc(0, n);
  };
  custom.free = [&](void* p) {
    ++frees;
    sim->segment_free(0, p);
  };
  alloc->create_or_incref_pool(0, P, custom);
  alloc->begin_allocate_to_pool(0, P, only(S1));
  void* a = m(3 * MiB, S1);
  void* b = m(4 * KiB, S1);
  alloc->end_allocate_to_pool(0, P);
  void* c = m(3 * MiB, S1);
  EXPECT_EQ(mallocs, 2) << "one large and one small segment";
  for (const segment_info& s : dev().segments())
    if (s.pool == P) {
      EXPECT_FALSE(s.is_expandable) << "custom segments are plain";
    }
  EXPECT_EQ(alloc->get_pool_stats(0, P).reserved_bytes, 20 * MiB + 2 * MiB);
  for (void* p : {a, b, c}) alloc->free(p);
  alloc->release_pool(0, P);
  alloc->empty_cache();
  EXPECT_EQ(frees, 2);
  EXPECT_EQ(reserved(), 0);
}

// An allocation's out-of-memory retry returns cached segments of every pool,
// including those of released pools; one whose segment free fails stays
// cached and the retry goes on (found by a breaker run: the malloc failed
// with the other pool's backend_error).
TEST(PoolsRetryTest, AFailingFreeOfAReleasedPoolDoesNotFailTheRetry) {
  sim_options o;
  o.capacity_bytes = 256 * MiB;
  auto sim = std::make_shared<sim_backend>(o);
  adopt_test_streams(*sim);
  caching_allocator alloc(sim, allocator_config::parse("expandable_segments:False,trim_on_new_peak:False"));
  alloc.init(1);
  bool fail_free = false;
  int frees = 0;
  segment_allocator custom;
  custom.malloc = [&](std::size_t n) { return sim->segment_malloc(0, n); };
  custom.free = [&](void* ptr) {
    if (fail_free) throw backend_error("test: the pool's segment free fails");
    ++frees;
    sim->segment_free(0, ptr);
  };
  alloc.create_or_incref_pool(0, P, custom);
  alloc.begin_allocate_to_pool(0, P, [](stream_t s) { return s == S1; });
  alloc.free(alloc.malloc(0, 100 * MiB, S1));
  alloc.end_allocate_to_pool(0, P);
  alloc.release_pool(0, P);             // dead, its 100 MiB segment cached
  alloc.free(alloc.malloc(0, 100 * MiB, 0));  // 100 MiB cached in the default pool
  fail_free = true;
  void* big = alloc.malloc(0, 150 * MiB, S2);  // needs the default pool's cache back
  EXPECT_NE(big, nullptr);
  EXPECT_EQ(alloc.get_pool_stats(0, P).reserved_bytes, 100 * MiB) << "the failing segment stays cached";
  EXPECT_EQ(alloc.get_device_stats(0).num_ooms, 0);
  EXPECT_THROW(alloc.empty_cache(), backend_error) << "emptyCache still reports the failure";
  fail_free = false;
  alloc.free(big);
  alloc.empty_cache();
  EXPECT_EQ(frees, 1);
  EXPECT_EQ(alloc.get_device_stats(0).reserved_bytes[0].current, 0);
  alloc.device_allocator(0).check_invariants();
}

// ---- capture semantics --------------------------------------------------------------------------

TEST_P(PoolsTest, WhileCapturingNoEventIsQueriedAndMultiStreamFreesAreDeferred) {
  alloc->create_or_incref_pool(0, P);
  // An event pending from before the capture.
  void* old = m(4 * KiB, S1);
  alloc->record_stream(old, S2);
  sim->enqueue_work(0, S2, 100);
  alloc->free(old);
  EXPECT_EQ(state_of(old), block_state::active_pending_free);

  sim->begin_capture(0, S1);
  alloc->begin_allocate_to_pool(0, P, only(S1));
  void* x = m(8 * KiB, S1);  // the sim throws if the allocator queries the pending event now
  void* y = m(8 * KiB, S3);  // not routed, same rule
  EXPECT_EQ(pool_of(x), P);
  EXPECT_EQ(pool_of(y), mempool_id_t{});
  alloc->record_stream(x, S2);
  alloc->free(x);
  EXPECT_EQ(state_of(x), block_state::active_pending_free) << "deferred, no event recorded";
  EXPECT_EQ(alloc->get_pool_stats(0, P).allocated_bytes, 0u);
  EXPECT_EQ(alloc->get_pool_stats(0, P).active_bytes, 8 * KiB);
  const auto r = reserved();
  alloc->empty_cache();  // may neither wait nor free while capturing
  EXPECT_EQ(reserved(), r);
  dev().check_invariants();

  alloc->end_allocate_to_pool(0, P);
  EXPECT_EQ(state_of(x), block_state::active_pending_free) << "stream 1 still captures (backend says so)";
  sim->end_capture(0, S1);
  sim->advance_to(200);
  alloc->empty_cache();
  EXPECT_EQ(state_of(x), block_state::inactive) << "events recorded after the capture, then completed";
  EXPECT_EQ(alloc->get_pool_stats(0, P).active_bytes, 0u);
  EXPECT_GT(alloc->get_pool_stats(0, P).reserved_bytes, 0u) << "the pool has a user: its segment stays";
  alloc->free(y);
}

TEST_P(PoolsTest, OutOfMemoryWhileCapturingFailsWithoutFreeingOrWaiting) {
  make(64 * MiB);
  void* cached = m(30 * MiB, S3);
  alloc->free(cached);  // cached in the default pool: freeing it would need cudaFree
  alloc->create_or_incref_pool(0, P);
  sim->begin_capture(0, S1);
  alloc->begin_allocate_to_pool(0, P, only(S1));
  EXPECT_THROW((void)m(40 * MiB, S1), out_of_memory_error);
  alloc->end_allocate_to_pool(0, P);
  sim->end_capture(0, S1);
  // Now the cached 30 MiB may be returned or moved. (With expandable
  // segments the pool may keep pages it mapped before running out.)
  void* a = m(25 * MiB, S1);
  alloc->free(a);
}

TEST_P(PoolsTest, ABackendCaptureWithoutPoolsDefersTooUntilItEnds) {
  void* x = m(8 * KiB, S1);
  alloc->record_stream(x, S2);
  sim->begin_capture(0, S1);
  alloc->free(x);
  EXPECT_EQ(state_of(x), block_state::active_pending_free);
  sim->end_capture(0, S1);
  alloc->empty_cache();
  EXPECT_EQ(reserved(), 0) << "x came back after the capture, then its segment went back";
}

TEST(SimCapture, CallsThatCudaRejectsDuringCaptureThrow) {
  sim_backend sim;
  adopt_test_streams(sim);
  const event_t e = sim.create_event(0);
  sim.record_event(0, e, S1);
  sim.begin_capture(0, S1);
  EXPECT_TRUE(sim.is_capturing(0, S1));
  EXPECT_FALSE(sim.is_capturing(0, S2));
  try {
    (void)sim.query_event(0, e);
    ADD_FAILURE() << "no error";
  } catch (const backend_error& err) {
    EXPECT_NE(std::string(err.what()).find("while stream 11 is capturing"), std::string::npos) << err.what();
  }
  EXPECT_THROW(sim.synchronize_event(0, e), backend_error);
  EXPECT_THROW(sim.synchronize_device(0), backend_error);
  EXPECT_THROW(sim.begin_capture(0, S1), backend_error);
  sim.end_capture(0, S1);
  EXPECT_THROW(sim.end_capture(0, S1), backend_error);
  EXPECT_TRUE(sim.query_event(0, e));
  sim.destroy_event(0, e);
}

// ---- F24: checkpoints ------------------------------------------------------------------------------

TEST_P(PoolsTest, CheckpointRestoreFreesAndRecreatesBlocks) {
  alloc->create_or_incref_pool(0, P);
  alloc->begin_allocate_to_pool(0, P, only(S1));
  void* a = m(64 * KiB, S1);
  void* b = m(128 * KiB, S1);
  void* c = m(64 * KiB, S1);
  alloc->end_allocate_to_pool(0, P);
  const pool_checkpoint cp = alloc->get_checkpoint_state(0, P);
  EXPECT_EQ(cp.device, 0);
  EXPECT_EQ(cp.pool, P);
  ASSERT_EQ(cp.segments.size(), 1u);
  std::size_t allocated = 0;
  for (const checkpoint_block& cb : cp.segments[0].blocks)
    if (cb.allocated) {
      ++allocated;
      if (cb.address == U(b)) {
        EXPECT_EQ(cb.requested_bytes, 128 * KiB);
      }
    }
  EXPECT_EQ(allocated, 3u);
  EXPECT_EQ(cp.segments[0].stream, S1);

  // Change the layout: free b, allocate d (smaller, in b's place) and e.
  alloc->free(b);
  alloc->begin_allocate_to_pool(0, P, only(S1));
  void* d = m(32 * KiB, S1);
  void* e = m(8 * KiB, S1);
  alloc->end_allocate_to_pool(0, P);
  EXPECT_EQ(U(d), U(b)) << "best fit takes b's place";
  const checkpoint_restore_result r = alloc->set_checkpoint_pool_state(0, cp);
  std::vector<void*> freed = r.freed_pointers;
  std::sort(freed.begin(), freed.end());
  std::vector<void*> want_freed{d, e};
  std::sort(want_freed.begin(), want_freed.end());
  EXPECT_EQ(freed, want_freed);
  ASSERT_EQ(r.blocks_created.size(), 1u);
  EXPECT_EQ(r.blocks_created[0].ptr, b);
  EXPECT_EQ(dev().block_size(r.blocks_created[0].block), 128 * KiB);
  EXPECT_TRUE(alloc->check_pool_live_allocations(0, P, {a, b, c}));
  EXPECT_THROW(alloc->free(e), invalid_argument_error) << "the restore freed e: the caller must not";
  const pool_checkpoint again = alloc->get_checkpoint_state(0, P);
  ASSERT_EQ(again.segments.size(), 1u);
  ASSERT_EQ(again.segments[0].blocks.size(), cp.segments[0].blocks.size());
  for (std::size_t i = 0; i < again.segments[0].blocks.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(again.segments[0].blocks[i].address, cp.segments[0].blocks[i].address);
    EXPECT_EQ(again.segments[0].blocks[i].allocated, cp.segments[0].blocks[i].allocated);
  }
  // Restoring the same state again changes nothing.
  const checkpoint_restore_result none = alloc->set_checkpoint_pool_state(0, cp);
  EXPECT_TRUE(none.freed_pointers.empty());
  EXPECT_TRUE(none.blocks_created.empty());
  for (void* p : {a, b, c}) alloc->free(p);
}

TEST_P(PoolsTest, CheckpointRestoreWaitsForPendingFrees) {
  alloc->create_or_incref_pool(0, P);
  alloc->begin_allocate_to_pool(0, P, only(S1));
  void* a = m(64 * KiB, S1);
  alloc->end_allocate_to_pool(0, P);
  const pool_checkpoint cp = alloc->get_checkpoint_state(0, P);
  alloc->record_stream(a, S2);
  sim->enqueue_work(0, S2, 100);
  alloc->free(a);
  EXPECT_EQ(state_of(a), block_state::active_pending_free);
  const checkpoint_restore_result r = alloc->set_checkpoint_pool_state(0, cp);
  ASSERT_EQ(r.blocks_created.size(), 1u);
  EXPECT_EQ(r.blocks_created[0].ptr, a);
  EXPECT_GE(sim->now(), 100u) << "it waited for the event";
  alloc->free(a);
}

TEST_P(PoolsTest, CheckpointMisuseIsRejectedAndChangesNothing) {
  make(256 * MiB, 2);
  alloc->create_or_incref_pool(0, P);
  alloc->create_or_incref_pool(0, Q);
  alloc->begin_allocate_to_pool(0, P, only(S1));
  void* a = m(64 * KiB, S1);
  alloc->end_allocate_to_pool(0, P);
  alloc->begin_allocate_to_pool(0, Q, only(S1));
  void* q = m(3 * MiB, S1);
  alloc->end_allocate_to_pool(0, Q);
  const pool_checkpoint cp = alloc->get_checkpoint_state(0, P);
  alloc->free(a);
  const auto before = alloc->get_device_stats(0);

  std::string e = error_of([&] { (void)alloc->set_checkpoint_pool_state(1, cp); });
  EXPECT_NE(e.find("the checkpoint is of device 0, not of device 1"), std::string::npos) << e;
  pool_checkpoint other = alloc->get_checkpoint_state(0, Q);
  other.pool = P;  // Q's layout presented as P's
  e = error_of([&] { (void)alloc->set_checkpoint_pool_state(0, other); });
  EXPECT_NE(e.find("differs from the checkpoint's"), std::string::npos) << e;
  pool_checkpoint unknown = cp;
  unknown.pool = {9, 9};
  e = error_of([&] { (void)alloc->set_checkpoint_pool_state(0, unknown); });
  EXPECT_NE(e.find("has no private pool (9, 9)"), std::string::npos) << e;
  pool_checkpoint broken = cp;
  broken.segments[0].blocks[0].size_bytes += 512;
  e = error_of([&] { (void)alloc->set_checkpoint_pool_state(0, broken); });
  EXPECT_NE(e.find("do not tile"), std::string::npos) << e;
  pool_checkpoint missing = cp;
  missing.segments.clear();
  e = error_of([&] { (void)alloc->set_checkpoint_pool_state(0, missing); });
  EXPECT_NE(e.find("holds 1 segments but the checkpoint has 0"), std::string::npos) << e;
  alloc->begin_allocate_to_pool(0, Q, only(5));
  e = error_of([&] { (void)alloc->set_checkpoint_pool_state(0, cp); });
  EXPECT_NE(e.find("capture is underway"), std::string::npos) << e;
  alloc->end_allocate_to_pool(0, Q);
  EXPECT_THROW((void)alloc->get_checkpoint_state(0, {9, 9}), invalid_argument_error);

  const auto after = alloc->get_device_stats(0);
  EXPECT_EQ(after.allocation[0].current, before.allocation[0].current);
  EXPECT_EQ(after.reserved_bytes[0].current, before.reserved_bytes[0].current);
  EXPECT_TRUE(alloc->check_pool_live_allocations(0, P, {}));
  EXPECT_TRUE(alloc->check_pool_live_allocations(0, Q, {q}));
  alloc->free(q);
}

}  // namespace

namespace {

// Threads allocate and free on their own streams while another thread begins
// and ends allocation to a pool for some of those streams (SPEC X1 with
// pools): nothing is lost, every block returns to the pool it came from.
TEST(PoolsConcurrency, BeginEndRacesWithAllocationsOnOtherThreads) {
  auto sim = std::make_shared<sim_backend>();
  for (stream_t s = 10; s < 13; ++s) sim->adopt_stream(0, s);  // the workers' streams
  caching_allocator alloc(sim, allocator_config::parse(""));
  alloc.init(1);
  const mempool_id_t pool{3, 0};
  alloc.create_or_incref_pool(0, pool);
  std::atomic<int> errors{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < 3; ++t)
    workers.emplace_back([&, t] {
      const stream_t s = static_cast<stream_t>(10 + t);
      std::vector<void*> live;
      for (int i = 0; i < 3000; ++i) {
        try {
          if (live.size() < 8 && (i % 3 != 2 || live.empty())) {
            live.push_back(alloc.malloc(0, 512u * (1u + static_cast<unsigned>(i % 50)), s));
          } else {
            alloc.free(live.back());
            live.pop_back();
          }
        } catch (const std::exception&) {
          ++errors;
        }
      }
      for (void* p : live) alloc.free(p);
    });
  std::thread controller([&] {
    for (int i = 0; i < 300; ++i) {
      alloc.begin_allocate_to_pool(0, pool, [](stream_t x) { return x == 10 || x == 12; });
      std::this_thread::yield();
      alloc.end_allocate_to_pool(0, pool);
    }
  });
  controller.join();
  for (auto& w : workers) w.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_TRUE(alloc.check_pool_live_allocations(0, pool, {}));
  alloc.device_allocator(0).check_invariants();
  EXPECT_EQ(alloc.get_device_stats(0).allocation[0].current, 0);
  alloc.release_pool(0, pool);
  alloc.empty_cache();
  EXPECT_EQ(alloc.get_device_stats(0).reserved_bytes[0].current, 0);
  EXPECT_TRUE(alloc.device_allocator(0).pools().empty());
}

}  // namespace
