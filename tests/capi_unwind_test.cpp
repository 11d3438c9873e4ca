// A callback that ends its thread (pthread_exit: a forced unwind, as CPython
// does to a daemon thread that asks for the interpreter's lock while the
// interpreter finalizes): the thread ends cleanly, and the allocator stays
// usable by the other threads with exact statistics.
#include <ccalloc/ccalloc.h>

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>

#include <pthread.h>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

/// The thread that the callbacks end (the main thread runs them too).
thread_local bool tls_end_me = false;
thread_local int tls_calls = 0;

std::int64_t stat(ccalloc_allocator_t* a, const char* name) {
  std::int64_t v = -12345;
  EXPECT_EQ(ccalloc_get_device_stat(a, 0, name, &v), CCALLOC_OK) << ccalloc_last_error();
  return v;
}

ccalloc_allocator_t* make_allocator() {
  ccalloc_options_t o;
  ccalloc_options_init(&o);
  o.backend = CCALLOC_BACKEND_SIM;
  o.sim_capacity_bytes = 64 * MiB;
  o.config = "expandable_segments:False";
  ccalloc_allocator_t* a = nullptr;
  EXPECT_EQ(ccalloc_create(&o, &a), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_init(a, 1), CCALLOC_OK) << ccalloc_last_error();
  return a;
}

struct thread_job {
  ccalloc_allocator_t* a;
  void (*body)(ccalloc_allocator_t*);
  bool returned = false;  // set only if the body came back
};

void* run_job(void* arg) {
  auto* job = static_cast<thread_job*>(arg);
  tls_end_me = true;
  job->body(job->a);
  job->returned = true;
  return nullptr;
}

/// Runs `body` on a new pthread and waits for it; false if the thread's
/// body returned (the callback did not end the thread).
bool ended_inside(ccalloc_allocator_t* a, void (*body)(ccalloc_allocator_t*)) {
  thread_job job{a, body};
  pthread_t t;
  EXPECT_EQ(pthread_create(&t, nullptr, run_job, &job), 0);
  EXPECT_EQ(pthread_join(t, nullptr), 0);
  return !job.returned;
}

/// The main thread's malloc, free and empty_cache, then the figures.
void expect_usable(ccalloc_allocator_t* a, std::int64_t lost_bytes) {
  void* p = nullptr;
  ASSERT_EQ(ccalloc_malloc(a, 0, 4096, nullptr, &p), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(stat(a, "allocated_bytes.all.current"), lost_bytes + 4096);
  EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_ERROR_INVALID_ARGUMENT) << "freed once only";
  EXPECT_EQ(ccalloc_empty_cache(a), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(stat(a, "allocated_bytes.all.current"), lost_bytes);
  EXPECT_EQ(stat(a, "reserved_bytes.all.current"), lost_bytes == 0 ? 0 : 2 * static_cast<std::int64_t>(MiB));
}

void malloc_one(ccalloc_allocator_t* a) {
  void* p = nullptr;
  (void)ccalloc_malloc(a, 0, 4096, nullptr, &p);
}

void malloc_and_free(ccalloc_allocator_t* a) {
  void* p = nullptr;
  if (ccalloc_malloc(a, 0, 4096, nullptr, &p) == CCALLOC_OK) (void)ccalloc_delete(a, p);
}

void attach_tracker_ending_on(ccalloc_allocator_t* a, ccalloc_trace_action_t* action) {
  ASSERT_EQ(ccalloc_attach_trace_tracker(
                a,
                [](void* user, const ccalloc_trace_entry_t* e) {
                  if (tls_end_me && e->action == *static_cast<ccalloc_trace_action_t*>(user)) pthread_exit(nullptr);
                },
                action),
            CCALLOC_OK)
      << ccalloc_last_error();
}

}  // namespace

// The malloc was made when its alloc entry reaches the tracker: its block
// stays allocated (the pointer never reached the thread).
TEST(CApiForcedUnwind, TrackerEndingItsThreadInAMallocKeepsTheAllocatorUsable) {
  ccalloc_allocator_t* a = make_allocator();
  ccalloc_trace_action_t on = CCALLOC_TRACE_ALLOC;
  attach_tracker_ending_on(a, &on);
  EXPECT_TRUE(ended_inside(a, malloc_one));
  EXPECT_EQ(stat(a, "allocated_bytes.all.current"), 4096) << "the ended thread's block";
  expect_usable(a, 4096);
  ccalloc_destroy(a);
}

// The free was made when its entries reach the tracker: the block is free,
// the pointer no longer live, and the next malloc may take the block.
TEST(CApiForcedUnwind, TrackerEndingItsThreadInAFreeKeepsTheAllocatorUsable) {
  ccalloc_allocator_t* a = make_allocator();
  ccalloc_trace_action_t on = CCALLOC_TRACE_FREE_REQUESTED;
  attach_tracker_ending_on(a, &on);
  EXPECT_TRUE(ended_inside(a, malloc_and_free));
  EXPECT_EQ(stat(a, "allocated_bytes.all.current"), 0);
  expect_usable(a, 0);
  ccalloc_destroy(a);
}

// A context recorder that ends its thread: in a malloc (first call) nothing
// is allocated; in a free (second call) the block is freed all the same.
TEST(CApiForcedUnwind, RecorderEndingItsThreadKeepsTheAllocatorUsable) {
  static int end_on_call = 1;
  ccalloc_allocator_t* a = make_allocator();
  ccalloc_history_options_t h;
  ccalloc_history_options_init(&h);  // contexts at malloc and free
  h.record = [](void*) -> void* {
    if (tls_end_me && ++tls_calls == end_on_call) pthread_exit(nullptr);
    return nullptr;
  };
  ASSERT_EQ(ccalloc_record_history_ex(a, &h), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_TRUE(ended_inside(a, malloc_and_free));
  EXPECT_EQ(stat(a, "allocated_bytes.all.current"), 0) << "ended before the malloc";
  end_on_call = 2;
  EXPECT_TRUE(ended_inside(a, malloc_and_free));
  EXPECT_EQ(stat(a, "allocated_bytes.all.current"), 0) << "ended in the free: freed";
  expect_usable(a, 0);
  ccalloc_destroy(a);
}

// An out-of-memory observer that ends its thread (it runs with no lock held).
TEST(CApiForcedUnwind, OutOfMemoryObserverEndingItsThreadKeepsTheAllocatorUsable) {
  ccalloc_allocator_t* a = make_allocator();
  ASSERT_EQ(ccalloc_attach_out_of_memory_observer(
                a, [](void*, int, std::size_t, std::size_t, std::size_t) { pthread_exit(nullptr); }, nullptr),
            CCALLOC_OK);
  EXPECT_TRUE(ended_inside(a, [](ccalloc_allocator_t* alloc) {
    void* p = nullptr;
    (void)ccalloc_malloc(alloc, 0, 128 * MiB, nullptr, &p);  // twice the device
  }));
  EXPECT_EQ(stat(a, "num_ooms"), 1);
  expect_usable(a, 0);
  ccalloc_destroy(a);
}
