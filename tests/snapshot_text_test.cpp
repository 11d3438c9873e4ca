// snapshot_text_test.cpp: the snapshot JSON and pickle are valid UTF-8
// whatever bytes the frames hold (valid_utf8), and the C API's snapshot
// call works by its header's recipe while history is recorded.
#include <ccalloc/ccalloc.h>

#include <ccalloc/core/snapshot.hpp>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace {

const std::string fffd = "\xef\xbf\xbd";

TEST(SnapshotText, ValidUtf8ReplacesEachInvalidByte) {
  EXPECT_EQ(ccalloc::valid_utf8("\xff\xfe"), fffd + fffd);
  EXPECT_EQ(ccalloc::valid_utf8("a\x80z"), "a" + fffd + "z");              // lone continuation byte
  EXPECT_EQ(ccalloc::valid_utf8("\xc0\xaf"), fffd + fffd);                 // overlong '/'
  EXPECT_EQ(ccalloc::valid_utf8("\xe0\x80\xaf"), fffd + fffd + fffd);      // overlong, 3 bytes
  EXPECT_EQ(ccalloc::valid_utf8("\xf0\x80\x80\xaf"), fffd + fffd + fffd + fffd);  // overlong, 4 bytes
  EXPECT_EQ(ccalloc::valid_utf8("\xed\xa0\x80"), fffd + fffd + fffd);      // surrogate U+D800
  EXPECT_EQ(ccalloc::valid_utf8("\xf4\x90\x80\x80"), fffd + fffd + fffd + fffd);  // above U+10FFFF
  EXPECT_EQ(ccalloc::valid_utf8("x\xe2\x82"), "x" + fffd + fffd);          // truncated at the end
  EXPECT_EQ(ccalloc::valid_utf8("\xe2\x82x"), fffd + fffd + "x");          // truncated in the middle
  const std::string valid = "plain, caf\xc3\xa9, \xe2\x82\xac, \xf0\x9f\x98\x80, \xef\xbf\xbd, \xf4\x8f\xbf\xbf";
  EXPECT_EQ(ccalloc::valid_utf8(valid), valid);
  EXPECT_EQ(ccalloc::valid_utf8(std::string("a\0b", 3)), std::string("a\0b", 3));
}

struct c_allocator {
  ccalloc_allocator_t* a = nullptr;
  c_allocator() {
    ccalloc_options_t o;
    ccalloc_options_init(&o);
    o.backend = CCALLOC_BACKEND_SIM;
    o.sim_capacity_bytes = std::size_t{1} << 30;
    EXPECT_EQ(ccalloc_create(&o, &a), CCALLOC_OK) << ccalloc_last_error();
    EXPECT_EQ(ccalloc_init(a, 1), CCALLOC_OK) << ccalloc_last_error();
  }
  ~c_allocator() { ccalloc_destroy(a); }
  c_allocator(const c_allocator&) = delete;
  c_allocator& operator=(const c_allocator&) = delete;
};

// Frames as a C recorder might deliver them: bytes read from a binary, not text.
void record_with_frames(ccalloc_allocator_t* a, void (*frames)(void*, void*, ccalloc_frame_sink_fn, void*)) {
  ccalloc_history_options_t h;
  ccalloc_history_options_init(&h);
  h.record = [](void*) -> void* { return reinterpret_cast<void*>(std::uintptr_t{1}); };
  h.release = [](void*, void*) {};
  h.frames = frames;
  ASSERT_EQ(ccalloc_record_history_ex(a, &h), CCALLOC_OK) << ccalloc_last_error();
}

std::string snapshot_by_the_recipe(ccalloc_allocator_t* a) {
  // The recipe of ccalloc.h: capacity 0 for the size, then *length + 1.
  size_t length = 0;
  EXPECT_EQ(ccalloc_snapshot_json(a, 1, NULL, 0, &length), CCALLOC_OK) << ccalloc_last_error();
  std::vector<char> buffer(length + 1);
  size_t filled = 0;
  EXPECT_EQ(ccalloc_snapshot_json(a, 1, buffer.data(), length + 1, &filled), CCALLOC_OK);
  EXPECT_EQ(filled, length) << "the size query's length must be the length the next call writes";
  return std::string(buffer.data(), std::min(filled, length));
}

TEST(SnapshotText, InvalidUtf8InFramesBecomesReplacementCharacters) {
  c_allocator c;
  record_with_frames(c.a, [](void*, void*, ccalloc_frame_sink_fn sink, void* sink_data) {
    sink(sink_data, "\xc0\xaf name\x80", "\xff\xfe", 7);
    sink(sink_data, "caf\xc3\xa9 \xe2\x82\xac", "tab\there\x01.py", 8);
  });
  void* p = nullptr;
  ASSERT_EQ(ccalloc_malloc(c.a, 0, 4096, nullptr, &p), CCALLOC_OK);
  const std::string text = snapshot_by_the_recipe(c.a);
  EXPECT_EQ(text.find('\xff'), std::string::npos);
  EXPECT_NE(text.find("\"filename\":\"" + fffd + fffd + "\""), std::string::npos) << text.substr(0, 800);
  EXPECT_NE(text.find("\"name\":\"" + fffd + fffd + " name" + fffd + "\""), std::string::npos);
  EXPECT_NE(text.find("\"name\":\"caf\xc3\xa9 \xe2\x82\xac\""), std::string::npos) << "valid text unchanged";
  EXPECT_NE(text.find(R"("filename":"tab\there\u0001.py")"), std::string::npos) << "control characters escaped";
  nlohmann::json parsed;
  ASSERT_NO_THROW(parsed = nlohmann::json::parse(text)) << "nlohmann's parser refuses invalid UTF-8";
  EXPECT_EQ(parsed["device_traces"][0][0]["frames"][0]["filename"], fffd + fffd);
  // The pickle writer uses the same function.
  ccalloc::memory_snapshot s;
  s.segments.emplace_back();
  s.segments.back().tag = "\xff";
  const std::string pickle = ccalloc::to_pickle(s);
  EXPECT_EQ(pickle.find(std::string("X\x01\0\0\0\xff", 6)), std::string::npos) << "the raw byte is not written";
  EXPECT_NE(pickle.find(std::string("X\x03\0\0\0", 5) + fffd), std::string::npos);
  EXPECT_EQ(ccalloc_delete(c.a, p), CCALLOC_OK);
}

TEST(SnapshotText, HeaderRecipeFitsWhileHistoryIsRecorded) {
  c_allocator c;
  ASSERT_EQ(ccalloc_record_history(c.a, 1, 100000), CCALLOC_OK) << ccalloc_last_error();
  void* p = nullptr;
  ASSERT_EQ(ccalloc_malloc(c.a, 0, 4096, nullptr, &p), CCALLOC_OK);
  std::vector<std::size_t> lengths;
  for (int i = 0; i < 3; ++i) {
    const std::string text = snapshot_by_the_recipe(c.a);
    EXPECT_TRUE(nlohmann::json::accept(text)) << "the text is complete";
    lengths.push_back(text.size());
  }
  // Each complete snapshot adds its `snapshot` entry, seen by the next one.
  EXPECT_LT(lengths[0], lengths[1]);
  EXPECT_EQ(lengths[2] - lengths[1], lengths[1] - lengths[0]);
  const auto traces = nlohmann::json::parse(snapshot_by_the_recipe(c.a))["device_traces"][0];
  int snapshots = 0;
  for (const auto& e : traces) snapshots += e["action"] == "snapshot";
  EXPECT_EQ(snapshots, 3) << "one per complete snapshot, none for the size queries";
  // A too small buffer records nothing either: the length stays.
  size_t length = 0;
  char small[16];
  ASSERT_EQ(ccalloc_snapshot_json(c.a, 1, small, sizeof small, &length), CCALLOC_OK);
  size_t again = 0;
  ASSERT_EQ(ccalloc_snapshot_json(c.a, 1, small, sizeof small, &again), CCALLOC_OK);
  EXPECT_EQ(again, length);
  EXPECT_EQ(small[15], '\0');
  EXPECT_EQ(ccalloc_delete(c.a, p), CCALLOC_OK);
}

}  // namespace
