// The C API of sleep and wake (ccalloc.h: ccalloc_tag_begin/end, ccalloc_pause,
// ccalloc_resume, ccalloc_tag_usage) on the simulated device.
#include <ccalloc/ccalloc.h>
#include <ccalloc/core/tags.hpp>

#include <gtest/gtest.h>

#include "heap_in_use.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
using ccalloc::testing::heap_bytes_in_use;

struct c_allocator {
  ccalloc_allocator_t* handle = nullptr;
  explicit c_allocator(std::size_t capacity_bytes) {
    ccalloc_options_t o;
    ccalloc_options_init(&o);
    o.backend = CCALLOC_BACKEND_SIM;
    o.sim_capacity_bytes = capacity_bytes;
    o.config = "";
    EXPECT_EQ(ccalloc_create(&o, &handle), CCALLOC_OK) << ccalloc_last_error();
    EXPECT_EQ(ccalloc_init(handle, 1), CCALLOC_OK) << ccalloc_last_error();
  }
  ~c_allocator() { ccalloc_destroy(handle); }
  c_allocator(const c_allocator&) = delete;
  c_allocator& operator=(const c_allocator&) = delete;
};

TEST(CapiSleepWake, TagScopePauseResumeAndUsage) {
  c_allocator a(64 * MiB);
  EXPECT_STREQ(ccalloc_current_tag(), "default");
  ASSERT_EQ(ccalloc_tag_begin("capi_weights"), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_STREQ(ccalloc_current_tag(), "capi_weights");
  void* w = nullptr;
  ASSERT_EQ(ccalloc_malloc(a.handle, 0, 24 * MiB, nullptr, &w), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_tag_end(), CCALLOC_OK);
  EXPECT_STREQ(ccalloc_current_tag(), "default");
  std::memset(w, 0x5a, 24 * MiB);

  const char* tags[] = {"capi_weights"};
  size_t free_before = 0, total = 0, free_after = 0;
  ASSERT_EQ(ccalloc_mem_get_info(a.handle, 0, &free_before, &total), CCALLOC_OK);
  ccalloc_sleep_result_t r{};
  ASSERT_EQ(ccalloc_pause(a.handle, -1, tags, 1, 1, &r), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_mem_get_info(a.handle, 0, &free_after, &total), CCALLOC_OK);
  EXPECT_EQ(free_after - free_before, 24 * MiB);
  EXPECT_EQ(r.paused_bytes, 24 * MiB);
  EXPECT_EQ(r.copied_bytes, 24 * MiB);
  ccalloc_tag_usage_t u{};
  ASSERT_EQ(ccalloc_tag_usage(a.handle, 0, "capi_weights", &u), CCALLOC_OK);
  EXPECT_EQ(u.paused, 1);
  EXPECT_EQ(u.allocated_bytes, 24 * MiB);
  EXPECT_EQ(u.reserved_bytes, 0u);
  EXPECT_EQ(u.kept_bytes, 24 * MiB);

  // Another allocator's worth of memory (here: the default tag) fills the room.
  void* other = nullptr;
  ASSERT_EQ(ccalloc_malloc(a.handle, 0, 56 * MiB, nullptr, &other), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_resume(a.handle, 0, tags, 1, &r), CCALLOC_ERROR_OUT_OF_MEMORY);
  EXPECT_NE(std::string(ccalloc_last_error()).find("resuming tag 'capi_weights'"), std::string::npos)
      << ccalloc_last_error();
  ASSERT_EQ(ccalloc_delete(a.handle, other), CCALLOC_OK);
  ASSERT_EQ(ccalloc_resume(a.handle, 0, tags, 1, &r), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(static_cast<unsigned char*>(w)[24 * MiB - 1], 0x5a);
  EXPECT_EQ(static_cast<unsigned char*>(w)[0], 0x5a);
  ASSERT_EQ(ccalloc_delete(a.handle, w), CCALLOC_OK);
}

TEST(CapiSleepWake, BadCallsAreRefused) {
  c_allocator a(16 * MiB);
  EXPECT_EQ(ccalloc_tag_end(), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(ccalloc_tag_begin(nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(ccalloc_tag_begin("bad tag"), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(ccalloc_current_tag(), "default");
  const char* def[] = {"default"};
  EXPECT_EQ(ccalloc_pause(a.handle, 0, def, 1, 0, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  const char* null_tag[] = {nullptr};
  EXPECT_EQ(ccalloc_pause(a.handle, 0, null_tag, 1, 0, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(ccalloc_pause(a.handle, 0, nullptr, 1, 0, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  ccalloc_tag_usage_t u{};
  EXPECT_EQ(ccalloc_tag_usage(a.handle, 0, "never_seen_here", &u), CCALLOC_OK);
  EXPECT_EQ(u.segments, 0u);
}

// ccalloc_tag_end_named closes the named scope even when it is not the
// innermost (a generator leaving its `with` inside its caller's scope): the
// scopes above it stay open, and allocations carry the tag they would have
// carried had it never opened.
TEST(CapiSleepWake, TagEndNamedClosesItsOwnScopeOutOfOrder) {
  c_allocator a(64 * MiB);
  ASSERT_EQ(ccalloc_tag_begin("capi_kv"), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_tag_begin("capi_w"), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_tag_begin("capi_x"), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_tag_end_named("capi_kv"), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_STREQ(ccalloc_current_tag(), "capi_x");
  ASSERT_EQ(ccalloc_tag_end_named("capi_x"), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_STREQ(ccalloc_current_tag(), "capi_w");
  void* p = nullptr;
  ASSERT_EQ(ccalloc_malloc(a.handle, 0, 4 * MiB, nullptr, &p), CCALLOC_OK) << ccalloc_last_error();
  ccalloc_tag_usage_t u{};
  ASSERT_EQ(ccalloc_tag_usage(a.handle, 0, "capi_w", &u), CCALLOC_OK);
  EXPECT_EQ(u.allocated_bytes, 4 * MiB);
  ASSERT_EQ(ccalloc_tag_usage(a.handle, 0, "capi_kv", &u), CCALLOC_OK);
  EXPECT_EQ(u.allocated_bytes, 0u);
  ASSERT_EQ(ccalloc_tag_end_named("capi_w"), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_STREQ(ccalloc_current_tag(), "default") << "the tag from before the outermost scope";
  EXPECT_EQ(ccalloc_tag_end(), CCALLOC_ERROR_INVALID_ARGUMENT) << "every scope is closed";
  ASSERT_EQ(ccalloc_delete(a.handle, p), CCALLOC_OK);

  // Two scopes of one name: either may close first, the other stays open.
  ASSERT_EQ(ccalloc_tag_begin("capi_kv"), CCALLOC_OK);
  ASSERT_EQ(ccalloc_tag_begin("capi_w"), CCALLOC_OK);
  ASSERT_EQ(ccalloc_tag_begin("capi_kv"), CCALLOC_OK);
  ASSERT_EQ(ccalloc_tag_end_named("capi_kv"), CCALLOC_OK);
  EXPECT_STREQ(ccalloc_current_tag(), "capi_w");
  ASSERT_EQ(ccalloc_tag_end_named("capi_w"), CCALLOC_OK);
  EXPECT_STREQ(ccalloc_current_tag(), "capi_kv");
  ASSERT_EQ(ccalloc_tag_end_named("capi_kv"), CCALLOC_OK);
  EXPECT_STREQ(ccalloc_current_tag(), "default");
}

TEST(CapiSleepWake, TagEndNamedRefusesWhatItCannotCloseAndChangesNothing) {
  EXPECT_EQ(ccalloc_tag_end_named(nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(ccalloc_last_error(), "ccalloc: ccalloc_tag_end_named: tag is NULL");
  EXPECT_EQ(ccalloc_tag_end_named("capi_never_opened"), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(ccalloc_last_error(),
               "ccalloc: ccalloc_tag_end_named: no scope of tag 'capi_never_opened' that ccalloc_tag_begin "
               "opened is open on this thread");
  ASSERT_EQ(ccalloc_tag_begin("capi_kv"), CCALLOC_OK);
  EXPECT_EQ(ccalloc_tag_end_named("bad\nname"), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(ccalloc_tag_end_named("capi_w"), CCALLOC_ERROR_INVALID_ARGUMENT) << "interned, but not open";
  EXPECT_STREQ(ccalloc_current_tag(), "capi_kv");
  {
    // A C++ scope opened after it and still open: reopening the C scopes
    // above would lose its tag.
    ASSERT_EQ(ccalloc_tag_begin("capi_w"), CCALLOC_OK);
    const ccalloc::tag_scope inner("capi_x");
    EXPECT_EQ(ccalloc_tag_end_named("capi_kv"), CCALLOC_ERROR_INVALID_ARGUMENT);
    EXPECT_STREQ(ccalloc_last_error(), "ccalloc: ccalloc_tag_end_named: a C++ tag_scope opened after the scope of "
                                       "tag 'capi_kv' is still open on this thread");
    EXPECT_STREQ(ccalloc_current_tag(), "capi_x");
  }
  EXPECT_STREQ(ccalloc_current_tag(), "capi_w");
  ASSERT_EQ(ccalloc_tag_end_named("capi_kv"), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_STREQ(ccalloc_current_tag(), "capi_w");
  ASSERT_EQ(ccalloc_tag_end(), CCALLOC_OK);
  EXPECT_STREQ(ccalloc_current_tag(), "default");
}

// A name that can be no tag is INVALID_ARGUMENT for ccalloc_tag_usage, as
// for ccalloc_tag_begin (it read as a tag that never allocated), and the
// message names the rule broken.
TEST(CapiSleepWake, TagUsageOfABadNameIsRefused) {
  c_allocator a(16 * MiB);
  ccalloc_tag_usage_t u{};
  u.segments = 7;
  EXPECT_EQ(ccalloc_tag_usage(a.handle, 0, "", &u), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(ccalloc_last_error(), "ccalloc: tag name is empty; give 1 to 64 characters");
  EXPECT_EQ(u.segments, 7u) << "a refused call leaves *out as it was";
  EXPECT_EQ(ccalloc_tag_usage(a.handle, 0, "has space", &u), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ccalloc_last_error()).find("has a character outside letters, digits and _-.:/"),
            std::string::npos)
      << ccalloc_last_error();
  EXPECT_EQ(ccalloc_tag_usage(a.handle, 0, std::string(65, 'x').c_str(), &u), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_FALSE(ccalloc::find_tag("has space").has_value()) << "the refused name was interned";
  EXPECT_EQ(ccalloc_tag_usage(a.handle, 0, std::string(64, 'x').c_str(), &u), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(u.segments, 0u);
}

// A tag per request or per job (SPEC S1, P10, R7): tag_begin / malloc /
// tag_end / free for ever keeps the host heap flat, never runs the device's
// address space out (each tag's memory lives in reservations of its own),
// and a name used again after its tag was forgotten pauses and resumes as a
// fresh tag. About 0.2 s in the plain build.
class TagChurn : public ::testing::Test {
 protected:
  void make(std::size_t capacity) { c.emplace(capacity); a = c->handle; }
  // One request under a tag of its own: a block of `bytes`, freed.
  void use_once(const std::string& tag, std::size_t bytes) {
    ASSERT_EQ(ccalloc_tag_begin(tag.c_str()), CCALLOC_OK) << ccalloc_last_error();
    void* p = nullptr;
    const ccalloc_status_t st = ccalloc_malloc(a, 0, bytes, nullptr, &p);
    ASSERT_EQ(ccalloc_tag_end(), CCALLOC_OK);
    ASSERT_EQ(st, CCALLOC_OK) << ccalloc_last_error();
    ASSERT_EQ(ccalloc_delete(a, p), CCALLOC_OK) << ccalloc_last_error();
  }
  std::int64_t stat(const char* name) {
    std::int64_t v = -1;
    EXPECT_EQ(ccalloc_get_device_stat(a, 0, name, &v), CCALLOC_OK) << ccalloc_last_error();
    return v;
  }
  ccalloc_tag_usage_t usage(const char* tag) {
    ccalloc_tag_usage_t u{};
    EXPECT_EQ(ccalloc_tag_usage(a, 0, tag, &u), CCALLOC_OK) << ccalloc_last_error();
    return u;
  }
  std::optional<c_allocator> c;
  ccalloc_allocator_t* a = nullptr;
};

// Each tag's cached page goes when the device needs it (32 pages here), and
// the tag with it: its pool and its streams' pools (about 21 KB of host
// memory each) are given back. The names stay interned (a few dozen bytes
// each: docs/limitations.md), within the 1 MiB bound for 3,000 of them.
TEST_F(TagChurn, FreedTagsCostNoHostMemoryWithoutEmptyCache) {
  make(64 * MiB);
  std::size_t heap_after_first = 0;
  for (int i = 1; i <= 3000; ++i) {
    use_once("churn_a" + std::to_string(i), 512);
    if (i % 500 != 0) continue;
    const std::size_t heap = heap_bytes_in_use();
    if (i == 500) heap_after_first = heap;
    ASSERT_LE(heap, heap_after_first + MiB) << "the heap grew by " << (heap - heap_after_first) << " bytes over "
                                            << (i - 500) << " tags used once and freed";
  }
  EXPECT_LE(stat("segment.all.current"), 32);
}

// 100 tags each hold a page at once, then free their blocks: their cached
// pages stay until empty_cache, which forgets the tags with them.
TEST_F(TagChurn, EmptyCacheForgetsEveryTagThatHoldsNothing) {
  make(256 * MiB);
  const std::size_t before = heap_bytes_in_use();
  std::vector<void*> live;
  live.reserve(100);
  for (int i = 0; i < 100; ++i) {
    ASSERT_EQ(ccalloc_tag_begin(("churn_b" + std::to_string(i)).c_str()), CCALLOC_OK);
    void* p = nullptr;
    const ccalloc_status_t st = ccalloc_malloc(a, 0, 512, nullptr, &p);
    ASSERT_EQ(ccalloc_tag_end(), CCALLOC_OK);
    ASSERT_EQ(st, CCALLOC_OK) << ccalloc_last_error();
    live.push_back(p);
  }
  for (void* p : live) ASSERT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  EXPECT_EQ(stat("segment.all.current"), 100);
  const std::size_t cached = heap_bytes_in_use();
  ASSERT_EQ(ccalloc_empty_cache(a), CCALLOC_OK);
  // What stays: the interned names, spare block objects and lists' room,
  // about 1 KB a tag here; a tag's pools were about 21 KB.
  const std::size_t after = heap_bytes_in_use();
  EXPECT_EQ(stat("reserved_bytes.all.current"), 0);
  EXPECT_EQ(stat("segment.all.current"), 0);
  EXPECT_GT(cached, before + 100 * 8'000) << "100 cached tags cost less host memory than expected";
  EXPECT_LE(after, before + 100 * 2'000)
      << "empty_cache kept " << (after - before) << " bytes of 100 empty tags";
  const ccalloc_tag_usage_t u = usage("churn_b7");
  EXPECT_EQ(u.segments, 0u);
  EXPECT_EQ(u.reserved_bytes, 0u);
  EXPECT_EQ(u.paused, 0);
}

// 1,200 reservations of 141 GB need 169 TB of address space; a process has
// 128 TiB. Tags that hold nothing give theirs back before the allocator
// falls back to plain segments (no warning, every segment a reservation).
TEST_F(TagChurn, TagsUsedOnceNeverExhaustTheAddressSpace) {
  make(std::size_t{141} * 1000 * 1000 * 1000);
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 1200; ++i) use_once("churn_c" + std::to_string(i), 512);
  ccalloc_stream_t s = nullptr;
  ASSERT_EQ(ccalloc_stream_create(a, 0, &s), CCALLOC_OK);
  void* p = nullptr;
  ASSERT_EQ(ccalloc_malloc(a, 0, 3 * MiB, s, &p), CCALLOC_OK) << ccalloc_last_error();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("no address space left"), std::string::npos) << err;
  ccalloc_tag_begin("churn_c_last");
  void* t = nullptr;
  ASSERT_EQ(ccalloc_malloc(a, 0, 4 * MiB, nullptr, &t), CCALLOC_OK) << ccalloc_last_error();
  ccalloc_tag_end();
  const char* name = "churn_c_last";
  ccalloc_sleep_result_t r{};
  ASSERT_EQ(ccalloc_pause(a, 0, &name, 1, 1, &r), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(r.paused_bytes, 4 * MiB) << "the last tag's memory is not in a reservation of its own";
  ASSERT_EQ(ccalloc_resume(a, 0, &name, 1, &r), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_delete(a, t), CCALLOC_OK);
  EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  EXPECT_EQ(ccalloc_stream_destroy(a, 0, s), CCALLOC_OK);
}

// A name whose tag was forgotten (empty_cache) is a fresh tag when used
// again: its memory pauses and resumes with its contents; pause and resume
// of the forgotten name change nothing.
TEST_F(TagChurn, ANameUsedAgainAfterItsTagWasForgottenPausesAndResumes) {
  make(256 * MiB);
  use_once("churn_again", 512);
  ASSERT_EQ(ccalloc_empty_cache(a), CCALLOC_OK);
  const char* name = "churn_again";
  ccalloc_sleep_result_t r{};
  ASSERT_EQ(ccalloc_pause(a, 0, &name, 1, 1, &r), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(r.paused_bytes, 0u);
  EXPECT_EQ(usage(name).paused, 1);
  ASSERT_EQ(ccalloc_resume(a, 0, &name, 1, &r), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(usage(name).paused, 0);
  ASSERT_EQ(ccalloc_empty_cache(a), CCALLOC_OK);
  ASSERT_EQ(ccalloc_tag_begin(name), CCALLOC_OK);
  void* p = nullptr;
  ASSERT_EQ(ccalloc_malloc(a, 0, 3 * MiB, nullptr, &p), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_tag_end(), CCALLOC_OK);
  std::memset(p, 0x5a, 3 * MiB);
  ASSERT_EQ(ccalloc_pause(a, 0, &name, 1, 1, &r), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(r.paused_bytes, 4 * MiB);
  EXPECT_EQ(usage(name).reserved_bytes, 0u);
  ASSERT_EQ(ccalloc_resume(a, 0, &name, 1, &r), CCALLOC_OK) << ccalloc_last_error();
  const auto* b = static_cast<const unsigned char*>(p);
  EXPECT_EQ(b[0], 0x5a);
  EXPECT_EQ(b[3 * MiB - 1], 0x5a);
  EXPECT_EQ(usage(name).allocated_bytes, 3 * MiB);
  EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  ASSERT_EQ(ccalloc_empty_cache(a), CCALLOC_OK);
  EXPECT_EQ(usage(name).segments, 0u);
}

}  // namespace
