// capi_errors_test.cpp: the C API's error messages (ccalloc_last_error())
// all start with "ccalloc: ", and those of the C layer name the C function
// (docs/errors.md, "The C API"); the device-count bound of ccalloc.h.
#include <ccalloc/ccalloc.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace {

struct misuse {
  const char* what;             // for the failure message
  std::string expected_start;   // the message's start: "ccalloc: " and the function
  std::function<ccalloc_status_t()> call;
};

TEST(CApiErrors, EveryMisuseMessageHasThePrefixAndNamesTheFunction) {
  ccalloc_options_t o;
  ccalloc_options_init(&o);
  o.backend = CCALLOC_BACKEND_SIM;
  ccalloc_allocator_t* a = nullptr;
  ASSERT_EQ(ccalloc_create(&o, &a), CCALLOC_OK);
  ASSERT_EQ(ccalloc_init(a, 1), CCALLOC_OK);
  const char* null_tags[] = {nullptr};
  std::int64_t value = 0;
  std::size_t free_bytes = 0, total_bytes = 0;
  const std::vector<misuse> calls = {
      {"pause with a NULL tag", "ccalloc: ccalloc_pause: tags[0] is NULL",
       [&] { return ccalloc_pause(a, 0, null_tags, 1, 0, nullptr); }},
      {"resume with a NULL tag", "ccalloc: ccalloc_resume: tags[0] is NULL",
       [&] { return ccalloc_resume(a, 0, null_tags, 1, nullptr); }},
      {"tag_end with no scope", "ccalloc: ccalloc_tag_end: no scope of ccalloc_tag_begin is open on this thread",
       [] { return ccalloc_tag_end(); }},
      {"tag_begin of NULL", "ccalloc: ccalloc_tag_begin: tag is NULL", [] { return ccalloc_tag_begin(nullptr); }},
      {"device_count into NULL", "ccalloc: ccalloc_device_count: out is NULL",
       [&] { return ccalloc_device_count(a, nullptr); }},
      {"mem_get_info of a missing device", "ccalloc: ccalloc_mem_get_info: device 5 is out of range",
       [&] { return ccalloc_mem_get_info(a, 5, &free_bytes, &total_bytes); }},
      {"an unknown statistic", "ccalloc: ccalloc_get_device_stat: unknown statistic 'no_such'",
       [&] { return ccalloc_get_device_stat(a, 0, "no_such", &value); }},
      {"a NULL trace tracker", "ccalloc: ccalloc_attach_trace_tracker: fn is NULL",
       [&] { return ccalloc_attach_trace_tracker(a, nullptr, nullptr); }},
      {"a NULL mapping listener", "ccalloc: ccalloc_attach_mapping_listener: fn is NULL",
       [&] { return ccalloc_attach_mapping_listener(a, nullptr, nullptr); }},
      {"init of 2^20 devices", "ccalloc: ccalloc_init(1048576): at most 1024 devices (ccalloc::max_device_count)",
       [&] { return ccalloc_init(a, 1 << 20); }},
      {"init of no device", "ccalloc: ccalloc_init(0): device_count must be at least 1 (the devices to drive, from 0)",
       [&] { return ccalloc_init(a, 0); }},
      {"init of a negative count", "ccalloc: ccalloc_init(-1): device_count must be at least 1",
       [&] { return ccalloc_init(a, -1); }},
      {"init of more devices than the backend", "ccalloc: ccalloc_init(2): the 'sim' backend has 1 device(s)",
       [&] { return ccalloc_init(a, 2); }},
      // The front end's messages keep their words; a backend's get the prefix.
      {"destroying a stream never made", "ccalloc: destroy_stream: stream 20817 of device 0 is not a stream",
       [&] { return ccalloc_stream_destroy(a, 0, reinterpret_cast<ccalloc_stream_t>(std::uintptr_t{0x5151})); }},
      {"synchronizing a stream never made", "ccalloc: sim: synchronize_stream: stream 20817 is not a stream",
       [&] { return ccalloc_stream_synchronize(a, 0, reinterpret_cast<ccalloc_stream_t>(std::uintptr_t{0x5151})); }},
  };
  for (const misuse& m : calls) {
    EXPECT_NE(m.call(), CCALLOC_OK) << m.what;
    const std::string message = ccalloc_last_error();
    EXPECT_EQ(message.rfind(m.expected_start, 0), 0u) << m.what << ": " << message;
  }
  ccalloc_destroy(a);
}

// A device count is bounded (CCALLOC_MAX_DEVICE_COUNT): a simulated backend
// of 2^20 devices is refused at once instead of exhausting the host (its
// peer table alone would be 2^40 entries).
TEST(CApiErrors, SimulatedDeviceCountIsBounded) {
  static_assert(CCALLOC_MAX_DEVICE_COUNT == 1024);
  ccalloc_options_t o;
  ccalloc_options_init(&o);
  o.backend = CCALLOC_BACKEND_SIM;
  ccalloc_allocator_t* a = reinterpret_cast<ccalloc_allocator_t*>(0x1);
  for (const int count : {CCALLOC_MAX_DEVICE_COUNT + 1, 0, -1, 1 << 20}) {
    o.sim_device_count = count;
    ASSERT_EQ(ccalloc_create(&o, &a), CCALLOC_ERROR_INVALID_ARGUMENT) << count;
    EXPECT_EQ(std::string(ccalloc_last_error()),
              "ccalloc: ccalloc_create: sim_device_count is " + std::to_string(count) +
                  "; it must be from 1 to 1024 (CCALLOC_MAX_DEVICE_COUNT)");
    EXPECT_EQ(a, reinterpret_cast<ccalloc_allocator_t*>(0x1)) << "output unchanged";
  }
  // At the bound it works: 1024 simulated devices, the last one usable.
  o.sim_device_count = CCALLOC_MAX_DEVICE_COUNT;
  ASSERT_EQ(ccalloc_create(&o, &a), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_init(a, CCALLOC_MAX_DEVICE_COUNT), CCALLOC_OK) << ccalloc_last_error();
  void* p = nullptr;
  EXPECT_EQ(ccalloc_malloc(a, CCALLOC_MAX_DEVICE_COUNT - 1, 4096, nullptr, &p), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  ccalloc_destroy(a);
}

}  // namespace
