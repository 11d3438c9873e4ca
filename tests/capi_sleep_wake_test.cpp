// The C API of sleep and wake (ccalloc.h: ccalloc_tag_begin/end, ccalloc_pause,
// ccalloc_resume, ccalloc_tag_usage) on the simulated device.
#include <ccalloc/ccalloc.h>
#include <ccalloc/core/tags.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

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

}  // namespace
