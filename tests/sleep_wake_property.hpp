// sleep_wake_property.hpp: the property test of sleep and wake (SPEC R2 for
// S1-S4), under concurrency: seeded random operations
// from several threads at once on one simulated device. Each worker thread
// owns a stream and a tag ("default" for one of them) and mallocs, frees,
// declares device work on its blocks (sim_backend::use_memory), pauses its
// tag (keeping contents or not) and resumes it, and, holding nothing,
// moves on to another of three names of its own (a job per tag: a tag that
// holds nothing is forgotten, and its name comes back as a fresh tag that
// holds nothing), while the others do the same on theirs (a third of the frees follow a record_stream on a second
// stream); one more thread calls empty_cache and the structural
// check. Invariants, checked as it runs and at the end:
//   - no page holds blocks of two tags (segments(): every page an allocated
//     block touches belongs to blocks of one tag);
//   - paused bytes are mapped nowhere (check_invariants: a paused
//     reservation has no mapped page; tag_stats: a paused tag reserves 0);
//   - a resumed block's contents equal what was kept (each block carries a
//     pattern of its own; after a resume with kept contents every live
//     block of the tag still holds it);
//   - no unsafe use: the device never touched an unmapped page
//     (unmapped_uses) nor unmapped a page under queued work (unsafe_unmaps);
//   - malloc under a paused tag fails with the paused-tag error and nothing
//     else; out of memory may happen (the device is small) and changes
//     nothing; at the end everything is freed and returned.
// Run by tests/property_test.cpp (Property.TaggedScopesPausesAndResumesFromSeveralThreads,
// plain and AddressSanitizer builds) and, in the concurrent test program,
// by tests/sleep_wake_property_test.cpp under ThreadSanitizer only
// (scripts/test.sh), so that each build runs it once. About 1 s plain.
#pragma once

#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/device_caching_allocator.hpp>
#include <ccalloc/core/tags.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace ccalloc_test::sleep_wake_property {

using namespace ccalloc;  // NOLINT: test code

constexpr std::size_t MiB = mib;
constexpr std::size_t page = 2 * MiB;

struct live_block {
  unsigned char* ptr;
  std::size_t size;
  unsigned char seed;
};

// The bytes a pattern covers: the first and last, and one per 64 KiB.
inline void write_pattern(const live_block& b) {
  for (std::size_t i = 0; i < b.size; i += 64 * 1024) b.ptr[i] = static_cast<unsigned char>(b.seed + i / 65536);
  b.ptr[b.size - 1] = b.seed;
}
inline bool holds_pattern(const live_block& b) {
  for (std::size_t i = 0; i < b.size; i += 64 * 1024)
    if (b.ptr[i] != static_cast<unsigned char>(b.seed + i / 65536)) return false;
  return b.ptr[b.size - 1] == b.seed;
}

struct totals {
  std::atomic<std::size_t> mallocs{0}, frees{0}, pauses{0}, kept_pauses{0}, resumes{0}, refused{0}, ooms{0},
      checked_blocks{0}, failed_resumes{0}, jobs{0};
};

class worker {
 public:
  worker(caching_allocator& a, sim_backend& sim, std::string tag, std::uint32_t seed, totals& t)
      : a_(a), sim_(sim), tag_(std::move(tag)), rng_(seed), t_(t), stream_(sim.create_stream(0)),
        side_(sim.create_stream(0)) {
    (void)ccalloc::intern_tag(tag_);  // named before its first malloc, as next_job's names are
  }

  // One operation; returns a failure message, or "".
  std::string step() {
    const unsigned op = rng_() % 100;
    if (paused_) {
      if (op < 40) return resume();
      if (op < 60 && !blocks_.empty()) return free_one();  // free of a paused block: done at resume
      if (op < 70) return malloc_refused();
      return "";
    }
    if (op < 45) return malloc_one();
    if (op < 80) return blocks_.empty() ? "" : free_one();
    if (op < 90) return use_one();
    if (op < 93 && tag_ != "default") return next_job();
    if (tag_ != "default") return pause(op < 95);
    return "";
  }

  std::string finish() {
    if (paused_) {
      for (int i = 0; i < 100 && paused_; ++i) {
        std::string err = resume();
        if (!err.empty()) return err;
        if (paused_) std::this_thread::yield();  // others hold the room: wait for their frees
      }
      if (paused_) return tag_ + ": resume never found room";
    }
    while (!blocks_.empty()) {
      std::string err = free_one();
      if (!err.empty()) return err;
    }
    return "";
  }

 private:
  std::string malloc_one() {
    const std::size_t sizes[] = {4096, 300 * 1024, MiB, 3 * MiB - 4096, 5 * MiB};
    const std::size_t n = sizes[rng_() % 5];
    void* p = nullptr;
    try {
      tag_scope scope(tag_);
      p = a_.malloc(0, n, stream_);
    } catch (const out_of_memory_error&) {
      ++t_.ooms;
      return "";
    }
    live_block b{static_cast<unsigned char*>(p), n, static_cast<unsigned char>(rng_())};
    write_pattern(b);
    blocks_.push_back(b);
    ++t_.mallocs;
    return "";
  }
  // A job done: the thread frees what the job holds, and its next blocks
  // carry another name (one of three, so that a name comes back after its
  // tag, holding nothing, may have been forgotten), which holds nothing of
  // an earlier job. (Waiting for a step with nothing held instead left some
  // runs with no job done in 250 steps.)
  std::string next_job() {
    while (!blocks_.empty())
      if (std::string err = free_one(); !err.empty()) return err;
    ++job_;
    tag_ = base_tag_ + "_j" + std::to_string(job_ % 3);
    // The job names its tag before its first malloc, as a program that may
    // pause the tag before allocating under it does: pause refuses a name
    // never interned in the process ("unknown tag"), and the next step may
    // be a pause (CI's TSan run hit that when an OOM had changed the order).
    (void)ccalloc::intern_tag(tag_);
    ++t_.jobs;
    for (const tag_usage& u : a_.tag_stats(0))
      if (u.tag == tag_ && (u.allocated_bytes != 0 || u.paused))
        return tag_ + ": a name used again holds " + std::to_string(u.allocated_bytes) +
               " allocated bytes, paused=" + std::to_string(u.paused);
    return "";
  }
  std::string malloc_refused() {
    try {
      tag_scope scope(tag_);
      void* p = a_.malloc(0, 4096, stream_);
      a_.free(p);
      return tag_ + ": malloc under the paused tag succeeded";
    } catch (const invalid_argument_error& e) {
      if (std::string(e.what()).find("the tag is paused") == std::string::npos) return e.what();
      ++t_.refused;
      return "";
    }
  }
  std::string free_one() {
    const std::size_t i = rng_() % blocks_.size();
    if (!paused_ && !holds_pattern(blocks_[i])) return tag_ + ": a live block lost its bytes before its free";
    // Used on a second stream too, a third of the time: its free waits for
    // an event, which any thread's malloc may find completed and return
    // while this tag's pause runs.
    if (!paused_ && rng_() % 3 == 0) a_.record_stream(blocks_[i].ptr, side_);
    a_.free(blocks_[i].ptr);
    blocks_[i] = blocks_.back();
    blocks_.pop_back();
    ++t_.frees;
    return "";
  }
  std::string use_one() {
    if (blocks_.empty()) return "";
    const live_block& b = blocks_[rng_() % blocks_.size()];
    sim_.enqueue_work(0, stream_, sim_.now() + 1 + rng_() % 50);
    sim_.use_memory(0, b.ptr, b.size, stream_);
    return "";
  }
  std::string pause(bool keep) {
    a_.pause({tag_}, keep, 0);
    paused_ = true;
    kept_ = keep;
    ++t_.pauses;
    if (keep) ++t_.kept_pauses;
    for (const tag_usage& u : a_.tag_stats(0))
      if (u.tag == tag_ && (!u.paused || u.reserved_bytes != 0))
        return tag_ + ": paused, yet tag_stats says paused=" + std::to_string(u.paused) + " reserved=" +
               std::to_string(u.reserved_bytes);
    return "";
  }
  std::string resume() {
    try {
      a_.resume({tag_}, 0);
    } catch (const out_of_memory_error&) {
      ++t_.failed_resumes;  // the others hold the device now; the tag stays paused
      for (const std::string& p : a_.paused_tags(0))
        if (p == tag_) return "";
      return tag_ + ": a failed resume left the tag active";
    }
    paused_ = false;
    ++t_.resumes;
    for (live_block& b : blocks_) {
      if (kept_) {
        if (!holds_pattern(b)) return tag_ + ": a resumed block's contents differ from what was kept";
        ++t_.checked_blocks;
      } else {
        write_pattern(b);  // contents were dropped: the block is writable again
      }
    }
    return "";
  }

  caching_allocator& a_;
  sim_backend& sim_;
  std::string tag_;
  std::string base_tag_ = tag_;
  unsigned job_ = 0;
  std::mt19937 rng_;
  totals& t_;
  stream_t stream_;
  stream_t side_;  // a second stream its blocks are used on (record_stream)
  std::vector<live_block> blocks_;
  bool paused_ = false;
  bool kept_ = false;
};

// Every page an allocated block touches holds blocks of one tag.
inline std::string pages_of_one_tag(device_caching_allocator& dev) {
  std::map<std::uintptr_t, std::string> owner;
  for (const segment_info& si : dev.segments())
    for (const block_info& b : si.blocks) {
      if (b.state != block_state::active_allocated) continue;
      for (std::uintptr_t pg = b.address / page; pg <= (b.address + b.size_bytes - 1) / page; ++pg) {
        auto [it, fresh] = owner.emplace(pg, b.tag);
        if (it->second != b.tag) return "page " + std::to_string(pg) + " holds blocks of " + it->second + " and " + b.tag;
      }
    }
  return "";
}

/// Runs the property with gtest assertions (fails the calling test).
inline void check_tagged_pauses_and_resumes_from_several_threads() {
  sim_options o;
  o.capacity_bytes = 48 * MiB;
  auto sim = std::make_shared<sim_backend>(o);
  caching_allocator a(sim, allocator_config::parse(""));
  a.init(1);
  totals t;
  const std::vector<std::string> tags = {"default", "prop_weights", "prop_kv", "prop_train"};
  constexpr int ops = 250;
  std::atomic<bool> done{false};
  std::mutex err_mutex;
  std::string first_error;
  auto fail = [&](const std::string& e) {
    std::lock_guard lock(err_mutex);
    if (first_error.empty()) first_error = e;
  };
  std::vector<std::thread> threads;
  for (std::size_t k = 0; k < tags.size(); ++k)
    threads.emplace_back([&, k] {
      worker w(a, *sim, tags[k], 0x51ee0000u + static_cast<std::uint32_t>(k), t);
      for (int i = 0; i < ops; ++i)
        if (std::string e = w.step(); !e.empty()) return fail("step " + std::to_string(i) + ": " + e);
      if (std::string e = w.finish(); !e.empty()) fail("finish: " + e);
    });
  std::thread checker([&] {
    while (!done.load()) {
      try {
        a.device_allocator(0).check_invariants();
      } catch (const std::exception& e) {
        fail(e.what());
      }
      if (std::string e = pages_of_one_tag(a.device_allocator(0)); !e.empty()) fail(e);
      a.empty_cache();
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  for (auto& th : threads) th.join();
  done = true;
  checker.join();
  ASSERT_TRUE(first_error.empty()) << first_error;
  a.device_allocator(0).check_invariants();
  a.empty_cache();
  EXPECT_EQ(a.get_device_stats(0).reserved_bytes[0].current, 0);
  EXPECT_EQ(sim->counters().unmapped_uses, 0u) << "the device touched a paused page";
  EXPECT_EQ(sim->counters().unsafe_unmaps, 0u) << "a page was unmapped under queued work";
  EXPECT_EQ(sim->counters().host_bytes, 0u) << "kept contents were not given back";
  std::printf("[ property ] sleep_wake: %zu mallocs, %zu frees, %zu pauses (%zu kept), %zu resumes (%zu failed "
              "for room), %zu refused mallocs, %zu OOMs, %zu blocks checked after resume, %zu jobs done\n",
              t.mallocs.load(), t.frees.load(), t.pauses.load(), t.kept_pauses.load(), t.resumes.load(),
              t.failed_resumes.load(), t.refused.load(), t.ooms.load(), t.checked_blocks.load(), t.jobs.load());
  EXPECT_GT(t.kept_pauses.load(), 0u);
  EXPECT_GT(t.pauses.load(), t.kept_pauses.load());
  EXPECT_GT(t.refused.load(), 0u);
  EXPECT_GT(t.checked_blocks.load(), 0u);
  EXPECT_GT(t.jobs.load(), 0u);
}

}  // namespace ccalloc_test::sleep_wake_property
