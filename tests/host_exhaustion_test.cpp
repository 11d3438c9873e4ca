// Threads whose first calls into the library come when the host's memory is
// exhausted get errors, not a stopped process: the library's per-thread
// state is made on first use without C++ thread_local destructors, which
// glibc registers in memory it allocates then, stopping the process when it
// cannot ("failed to register TLS destructor: out of memory";
// base/detail/thread_object.hpp).
#include <ccalloc/ccalloc.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

/// The child's work: 8 threads, started before the address space is
/// limited to what the process maps plus 64 MiB and then filled, each make
/// 50 mallocs (with a trace tracker and a tag scope) and read the message
/// of every failure. Exit status 0 when every failure had a message, 2
/// when one had none, 3 when nothing failed (the limit did not bite).
[[noreturn]] void first_calls_with_no_host_memory() {
  ccalloc_options_t o;
  ccalloc_options_init(&o);
  o.backend = CCALLOC_BACKEND_SIM;
  o.sim_capacity_bytes = std::size_t{1} << 30;
  ccalloc_allocator_t* a = nullptr;
  if (ccalloc_create(&o, &a) != CCALLOC_OK || ccalloc_init(a, 1) != CCALLOC_OK) std::_Exit(4);
  if (ccalloc_attach_trace_tracker(a, [](void*, const ccalloc_trace_entry_t*) {}, nullptr) != CCALLOC_OK)
    std::_Exit(4);
  std::atomic<bool> go{false};
  std::atomic<int> failed{0}, silent{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&] {
      while (!go) std::this_thread::yield();
      (void)ccalloc_tag_begin("first_calls");
      for (std::size_t k = 0; k < 50; ++k) {
        void* p = nullptr;
        if (ccalloc_malloc(a, 0, (k % 7 + 1) * MiB, nullptr, &p) == CCALLOC_OK) {
          (void)ccalloc_delete(a, p);
          continue;
        }
        ++failed;
        if (std::strncmp(ccalloc_last_error(), "ccalloc", 7) != 0) ++silent;
      }
      (void)ccalloc_tag_end();
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // Room for every pointer the filling below keeps, made before the limit:
  // growing the vector then would throw std::bad_alloc past the threads.
  std::vector<void*> eaten;
  eaten.reserve(std::size_t{1} << 16);
  unsigned long pages = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%lu", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  rlimit r{};
  getrlimit(RLIMIT_AS, &r);
  r.rlim_cur = pages * static_cast<unsigned long>(sysconf(_SC_PAGESIZE)) + 64 * MiB;
  if (pages == 0 || setrlimit(RLIMIT_AS, &r) != 0) std::_Exit(4);
  for (std::size_t size = MiB; size >= 64 && eaten.size() < eaten.capacity();) {
    if (void* p = std::malloc(size)) eaten.push_back(p);
    else size /= 2;
  }
  go = true;
  for (std::thread& t : threads) t.join();
  for (void* p : eaten) std::free(p);
  std::_Exit(silent != 0 ? 2 : failed == 0 ? 3 : 0);
}

TEST(HostExhaustion, ThreadsWhoseFirstCallsFindNoHostMemoryGetErrors) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a sanitizer's runtime needs far more address space than the limit leaves";
#endif
  for (int run = 0; run < 3; ++run) {
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) first_calls_with_no_host_memory();
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFEXITED(status)) << "the child was stopped by signal " << WTERMSIG(status)
                                   << " (run " << run << ")";
    EXPECT_EQ(WEXITSTATUS(status), 0) << "2: a failure without a message; 3: nothing failed; 4: no setup";
  }
}

}  // namespace
