// Tests of the configuration string (include/ccalloc/core/config.hpp): every
// key, its accepted range and error message, roundup_power2_divisions
// semantics interval by interval, cross-key rules, X6 warnings, to_string()
// round trips and CCALLOC_CONF.
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/config.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <exception>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace ccalloc {
namespace {

constexpr std::size_t unlimited = std::numeric_limits<std::size_t>::max();
constexpr std::size_t max_mib = unlimited / mib;  // 2^44 - 1

using divisions_array = std::array<std::size_t, roundup_intervals>;

/// Runs parse(text), expects config_error, returns its message.
std::string parse_error(const std::string& text) {
  try {
    (void)allocator_config::parse(text);
  } catch (const config_error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not contain '" << part << "'";
}

/// Sets or unsets an environment variable for one scope.
class scoped_env {
 public:
  scoped_env(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~scoped_env() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// ---- defaults and syntax ----------------------------------------------------

TEST(ConfigTest, EmptyAndBlankStringsGiveDefaults) {
  const allocator_config defaults;
  EXPECT_EQ(allocator_config::parse(""), defaults);
  EXPECT_EQ(allocator_config::parse("  \t "), defaults);
  EXPECT_EQ(allocator_config::parse(","), defaults);  // empty items are skipped
  EXPECT_EQ(defaults.max_split_size_bytes, unlimited);
  EXPECT_EQ(defaults.max_non_split_rounding_bytes, 20 * mib);
  EXPECT_EQ(defaults.large_segment_size_bytes, 20 * mib);
  EXPECT_EQ(defaults.garbage_collection_threshold, 0.0);
  EXPECT_EQ(defaults.roundup_power2_divisions, divisions_array{});
  EXPECT_EQ(defaults.per_process_memory_fraction, 1.0);
  EXPECT_FALSE(defaults.memory_fraction_set);
  EXPECT_EQ(defaults.backend, "native");
  EXPECT_TRUE(defaults.warnings.empty());
}

TEST(ConfigTest, DefaultsPrintCanonically) {
  EXPECT_EQ(allocator_config{}.to_string(),
            "max_non_split_rounding_mb:20,large_segment_size_mb:20,roundup_power2_divisions:0,"
            "release_lock_on_cudamalloc:False,trim_on_new_peak:True,reuse_across_streams:True,"
            "reuse_with_stream_wait:False,backend:native,pinned_use_cuda_host_register:False,pinned_num_register_threads:1,"
            "pinned_use_background_threads:False,graph_capture_record_stream_reuse:False");
}

TEST(ConfigTest, WhitespaceAroundTokensAndBracketCommas) {
  const auto config = allocator_config::parse(
      "  max_split_size_mb : 128 ,roundup_power2_divisions: [ 256 : 1 , 512:2 , > : 4 ] ,"
      " expandable_segments:True ,");
  EXPECT_EQ(config.max_split_size_bytes, 128 * mib);
  EXPECT_TRUE(config.expandable_segments);
  EXPECT_EQ(config.roundup_power2_divisions[8], 1u);
  EXPECT_EQ(config.roundup_power2_divisions[9], 2u);
  EXPECT_EQ(config.roundup_power2_divisions[10], 4u);
}

TEST(ConfigTest, DuplicateKeyLastWins) {
  const auto config = allocator_config::parse("max_split_size_mb:64,max_split_size_mb:256");
  EXPECT_EQ(config.max_split_size_bytes, 256 * mib);
}

TEST(ConfigTest, SyntaxErrors) {
  EXPECT_EQ(parse_error("foo"), "ccalloc config: expected key:value, got 'foo'");
  EXPECT_EQ(parse_error("max_split_size_mb:64, foo "),
            "ccalloc config: expected key:value, got 'foo'");
  EXPECT_EQ(parse_error(":5"), "ccalloc config: expected key:value, got ':5'");
  EXPECT_EQ(parse_error("max_split_size_mb:"),
            "ccalloc config: max_split_size_mb has no value (accepted: an integer number of "
            "MiB, at least large_segment_size_mb (20 by default))");
}

TEST(ConfigTest, UnknownKeyIsNamedWithSuggestionAndAcceptedKeys) {
  const auto message = parse_error("max_split_sz_mb:128");
  EXPECT_TRUE(contains(message, "ccalloc config: unknown key 'max_split_sz_mb'"));
  EXPECT_TRUE(contains(message, "did you mean 'max_split_size_mb'?"));
  std::string all_keys;
  for (const auto& info : config_keys()) {
    all_keys += (all_keys.empty() ? "" : ", ") + std::string(info.key);
  }
  EXPECT_TRUE(contains(message, "(accepted keys: " + all_keys + ")"));

  const auto far = parse_error("colour:blue");
  EXPECT_TRUE(contains(far, "unknown key 'colour'"));
  EXPECT_FALSE(contains(far, "did you mean"));
  // Keys are case-sensitive, as in PyTorch.
  EXPECT_TRUE(contains(parse_error("Expandable_Segments:True"), "did you mean 'expandable_segments'"));
}

// Control bytes of the input are escaped as \xHH in messages (breaker
// finding: the library echoed them raw, so a CCALLOC_CONF could clear the
// terminal of whoever read the error, or cut a C API message at a NUL).
TEST(ConfigTest, ControlBytesOfTheInputAreEscapedInMessages) {
  EXPECT_EQ(parse_error("expandable_segments:\x1b[2J"),
            "ccalloc config: expandable_segments:\\x1b[2J is not a valid value (accepted: True or "
            "False (also true/false, 1/0))");
  EXPECT_EQ(parse_error(std::string("expandable\0segments:True", 24)),
            "ccalloc config: unknown key 'expandable\\x00segments'; did you mean 'expandable_segments'? "
            "(accepted keys: " +
                [] {
                  std::string all;
                  for (const auto& info : config_keys()) all += (all.empty() ? "" : ", ") + std::string(info.key);
                  return all;
                }() +
                ")");
  EXPECT_EQ(parse_error("a\x07" "b"), "ccalloc config: expected key:value, got 'a\\x07b'");
  EXPECT_EQ(parse_error("roundup_power2_divisions:[1:\x7f]"),
            "ccalloc config: roundup_power2_divisions:[1:\\x7f] is not a valid value: divisions "
            "'\\x7f' is not a non-negative integer (accepted: 0 or a power of two, or a list "
            "[<MiB>:<d>,...,>:<d>] of increasing power-of-two sizes in MiB, optionally ending "
            "with >, each mapped to d = 0 or a power of two)");
  // Truncation still counts input bytes; the kept part is escaped.
  const std::string long_value = std::string(99, 'x') + "\x1b" + std::string(50, 'y');
  EXPECT_EQ(parse_error("backend:" + long_value),
            "ccalloc config: backend:" + std::string(99, 'x') +
                "\\x1b... (150 bytes) is not a valid value (accepted: native or cudaMallocAsync)");
}

// A newline or tab inside a quoted value is written \n or \t: the message
// stays one line, and a value cannot pass for the end of the message.
TEST(ConfigTest, NewlinesAndTabsOfTheInputAreEscapedInMessages) {
  EXPECT_EQ(parse_error("expandable_segments:Tr\nue"),
            "ccalloc config: expandable_segments:Tr\\nue is not a valid value (accepted: True or "
            "False (also true/false, 1/0))");
  EXPECT_EQ(parse_error("a\tb\nc"), "ccalloc config: expected key:value, got 'a\\tb\\nc'");
  EXPECT_TRUE(contains(parse_error("bogus\nkey:1"), "unknown key 'bogus\\nkey'"));
  EXPECT_TRUE(contains(parse_error("roundup_power2_divisions:[1:2\nx]"), "divisions '2\\nx'"));
  for (const char* text : {"expandable_segments:Tr\nue", "bogus\nkey:1", "max_split_size_mb:1\n2", "x\ny"})
    EXPECT_FALSE(contains(parse_error(text), "\n")) << text;
}

// ---- every key --------------------------------------------------------------

TEST(ConfigTest, EveryKeyParses) {
  std::set<std::string> tested;
  const auto parse_key = [&](const std::string& key, const std::string& value) {
    tested.insert(key);
    return allocator_config::parse(key + ":" + value);
  };

  EXPECT_EQ(parse_key("max_split_size_mb", "20").max_split_size_bytes, 20 * mib);
  EXPECT_EQ(parse_key("max_split_size_mb", "4096").max_split_size_bytes, 4096 * mib);
  EXPECT_EQ(parse_key("max_non_split_rounding_mb", "64").max_non_split_rounding_bytes, 64 * mib);
  {
    const auto c = parse_key("large_segment_size_mb", "12");
    EXPECT_EQ(c.large_segment_size_bytes, 12 * mib);
    EXPECT_EQ(c.max_non_split_rounding_bytes, 12 * mib);  // follows, as in PyTorch
  }
  EXPECT_EQ(parse_key("garbage_collection_threshold", "0.6").garbage_collection_threshold, 0.6);
  EXPECT_EQ(parse_key("garbage_collection_threshold", "5e-1").garbage_collection_threshold, 0.5);
  EXPECT_EQ(parse_key("roundup_power2_divisions", "4").roundup_power2_divisions,
            (divisions_array{4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4}));
  {
    // The default is True (where the device has virtual memory); given, it is kept and printed.
    EXPECT_TRUE(allocator_config{}.expandable_segments);
    EXPECT_FALSE(allocator_config{}.expandable_segments_set);
    const auto on = parse_key("expandable_segments", "True");
    EXPECT_TRUE(on.expandable_segments && on.expandable_segments_set);
    const auto off = parse_key("expandable_segments", "False");
    EXPECT_TRUE(!off.expandable_segments && off.expandable_segments_set);
    EXPECT_NE(off.to_string().find("expandable_segments:False"), std::string::npos);
    EXPECT_EQ(allocator_config{}.to_string().find("expandable_segments"), std::string::npos);
    EXPECT_FALSE(parse_key("reuse_across_streams", "False").reuse_across_streams);
    EXPECT_EQ(parse_key("reuse_across_streams", "True"), allocator_config{});  // the default
    EXPECT_TRUE(parse_key("reuse_with_stream_wait", "True").reuse_with_stream_wait);
    EXPECT_EQ(parse_key("reuse_with_stream_wait", "False"), allocator_config{});  // the default
    EXPECT_NE(parse_error("reuse_with_stream_wait:maybe").find("reuse_with_stream_wait:maybe"), std::string::npos);
  }
  {
    // thread_cache: off by default and not printed unless given.
    EXPECT_EQ(allocator_config{}.thread_cache, thread_cache_mode::off);
    EXPECT_FALSE(allocator_config{}.thread_cache_set);
    EXPECT_EQ(allocator_config{}.to_string().find("thread_cache"), std::string::npos);
    for (const auto& [text, mode] : {std::pair{"off", thread_cache_mode::off},
                                     std::pair{"small", thread_cache_mode::small},
                                     std::pair{"all", thread_cache_mode::all}}) {
      const auto c = parse_key("thread_cache", text);
      EXPECT_EQ(c.thread_cache, mode) << text;
      EXPECT_TRUE(c.thread_cache_set) << text;
      EXPECT_NE(c.to_string().find(std::string("thread_cache:") + text), std::string::npos) << c.to_string();
      EXPECT_EQ(allocator_config::parse(c.to_string()), c) << text;
      EXPECT_TRUE(c.warnings.empty()) << text;
    }
    EXPECT_EQ(parse_error("thread_cache:on"),
              "ccalloc config: thread_cache:on is not a valid value (accepted: off, small or all (also True/true/1 = all, "
            "False/false/0 = off))");
  }
  for (const char* key : {"release_lock_on_cudamalloc",
                          "pinned_use_cuda_host_register", "pinned_use_background_threads",
                          "graph_capture_record_stream_reuse"}) {
    for (const char* truthy : {"True", "true", "1"}) {
      const auto c = parse_key(key, truthy);
      const bool value = std::string(key) == "release_lock_on_cudamalloc"
                             ? c.release_lock_on_cudamalloc
                         : std::string(key) == "pinned_use_cuda_host_register"
                             ? c.pinned_use_cuda_host_register
                         : std::string(key) == "pinned_use_background_threads"
                             ? c.pinned_use_background_threads
                             : c.graph_capture_record_stream_reuse;
      EXPECT_TRUE(value) << key << ":" << truthy;
    }
    for (const char* falsy : {"False", "false", "0"}) {
      EXPECT_EQ(parse_key(key, falsy), allocator_config{}) << key << ":" << falsy;
    }
  }
  {
    const auto c = parse_key("per_process_memory_fraction", "0.75");
    EXPECT_EQ(c.per_process_memory_fraction, 0.75);
    EXPECT_TRUE(c.memory_fraction_set);
    EXPECT_EQ(parse_key("per_process_memory_fraction", "0").per_process_memory_fraction, 0.0);
    EXPECT_TRUE(parse_key("per_process_memory_fraction", "1").memory_fraction_set);
  }
  EXPECT_FALSE(parse_key("trim_on_new_peak", "False").trim_on_new_peak);
  EXPECT_FALSE(parse_key("trim_on_new_peak", "0").trim_on_new_peak);
  EXPECT_EQ(parse_key("trim_on_new_peak", "True"), allocator_config{});  // the default
  EXPECT_EQ(parse_error("trim_on_new_peak:maybe"),
            "ccalloc config: trim_on_new_peak:maybe is not a valid value (accepted: True or "
            "False (also true/false, 1/0))");
  EXPECT_EQ(parse_key("recycles_per_peak", "0").recycles_per_peak, 0u);
  EXPECT_EQ(parse_key("recycles_per_peak", "1000000").recycles_per_peak, 1000000u);
  EXPECT_EQ(parse_key("recycles_per_peak", "4").recycles_per_peak, 4u);
  EXPECT_EQ(parse_key("recycles_per_peak", "unlimited"), allocator_config{});  // the default
  EXPECT_NE(allocator_config::parse("recycles_per_peak:9").to_string().find("recycles_per_peak:9"),
            std::string::npos);
  EXPECT_NE(parse_error("recycles_per_peak:-1").find("recycles_per_peak:-1"), std::string::npos);
  // The largest count is how "unlimited" is kept: spelled as a number, it is refused, not taken as unlimited.
  EXPECT_EQ(parse_key("recycles_per_peak", "18446744073709551614").recycles_per_peak, 18446744073709551614u);
  EXPECT_EQ(parse_error("recycles_per_peak:18446744073709551615"),
            "ccalloc config: recycles_per_peak:18446744073709551615 is out of range: write 'unlimited' for no "
            "limit; a count must be below 2^64-1 (accepted: an integer >= 0, or unlimited)");
  // recycle_time_percent: 0-100, default 5; printed only when not the default.
  EXPECT_EQ(allocator_config{}.recycle_time_percent, 5u);
  EXPECT_EQ(parse_key("recycle_time_percent", "0").recycle_time_percent, 0u);
  EXPECT_EQ(parse_key("recycle_time_percent", "100").recycle_time_percent, 100u);
  EXPECT_EQ(parse_key("recycle_time_percent", "5"), allocator_config{});
  EXPECT_NE(allocator_config::parse("recycle_time_percent:20").to_string().find("recycle_time_percent:20"),
            std::string::npos);
  EXPECT_EQ(allocator_config{}.to_string().find("recycle_time_percent"), std::string::npos);
  EXPECT_NE(parse_error("recycle_time_percent:101").find("recycle_time_percent:101"), std::string::npos);
  EXPECT_NE(parse_error("recycle_time_percent:-1").find("recycle_time_percent:-1"), std::string::npos);
  EXPECT_NE(parse_error("recycle_time_percent:2.5").find("recycle_time_percent:2.5"), std::string::npos);
  // oom_snapshot: a path, printed only when set; oom_snapshot_interval_s: seconds, default 60.
  EXPECT_EQ(parse_key("oom_snapshot", "/tmp/oom.pickle").oom_snapshot_path, "/tmp/oom.pickle");
  EXPECT_EQ(allocator_config{}.oom_snapshot_path, "");
  EXPECT_EQ(allocator_config{}.to_string().find("oom_snapshot"), std::string::npos);
  EXPECT_NE(allocator_config::parse("oom_snapshot:a/b.pickle").to_string().find("oom_snapshot:a/b.pickle"),
            std::string::npos);
  EXPECT_EQ(allocator_config::parse(allocator_config::parse("oom_snapshot: x.pickle ").to_string()).oom_snapshot_path,
            "x.pickle");
  // A bracket in the path would group the settings printed after it into
  // one list item (found by fuzz_config): refused, naming the brackets.
  EXPECT_NE(parse_error("oom_snapshot:a[b.pickle").find("brackets"), std::string::npos);
  EXPECT_NE(parse_error("oom_snapshot:ab].pickle,backend:native").find("oom_snapshot:ab].pickle"), std::string::npos);
  EXPECT_EQ(allocator_config::parse("oom_snapshot:a:b.pickle").oom_snapshot_path, "a:b.pickle");
  EXPECT_EQ(allocator_config{}.oom_snapshot_interval_s, 60u);
  EXPECT_EQ(parse_key("oom_snapshot_interval_s", "0").oom_snapshot_interval_s, 0u);
  EXPECT_EQ(parse_key("oom_snapshot_interval_s", "60"), allocator_config{});
  EXPECT_NE(allocator_config::parse("oom_snapshot_interval_s:5").to_string().find("oom_snapshot_interval_s:5"),
            std::string::npos);
  EXPECT_NE(parse_error("oom_snapshot_interval_s:-1").find("oom_snapshot_interval_s:-1"), std::string::npos);
  EXPECT_NE(parse_error("oom_snapshot_interval_s:1.5").find("oom_snapshot_interval_s:1.5"), std::string::npos);
  EXPECT_EQ(parse_key("backend", "native").backend, "native");
  EXPECT_EQ(parse_key("backend", "cudaMallocAsync").backend, "cudaMallocAsync");
  EXPECT_EQ(parse_key("pinned_num_register_threads", "1").pinned_num_register_threads, 1u);
  EXPECT_EQ(parse_key("pinned_num_register_threads", "128").pinned_num_register_threads, 128u);
  EXPECT_EQ(parse_key("pinned_reserve_segment_size_mb", "64").pinned_reserve_segment_size_bytes,
            64 * mib);

  std::set<std::string> table;
  for (const auto& info : config_keys()) table.insert(std::string(info.key));
  EXPECT_EQ(tested, table) << "a key in config_keys() has no parse test (or vice versa)";
}

// PyTorch 2.8+ reads MiB counts with std::stoull and clamps them to
// SIZE_MAX / 1 MiB; ccalloc accepts the same values but warns (breaker
// finding: max_split_size_mb:18446744073709551615 was clamped silently).
TEST(ConfigTest, HugeMibValuesClampLikePyTorchAndWarn) {
  const auto split = allocator_config::parse("max_split_size_mb:18446744073709551615");
  EXPECT_EQ(split.max_split_size_bytes, max_mib * mib);
  ASSERT_EQ(split.warnings.size(), 1u);
  EXPECT_EQ(split.warnings[0],
            "ccalloc config: max_split_size_mb:17592186044415 is the largest value ccalloc keeps (larger "
            "values are clamped to it, as PyTorch does): about 16 EiB, more than any device has");
  EXPECT_EQ(allocator_config::parse("max_split_size_mb:99999999999999999").max_split_size_bytes,
            max_mib * mib);
  const auto segment = allocator_config::parse("large_segment_size_mb:99999999999999998");
  EXPECT_EQ(segment.large_segment_size_bytes, (max_mib - 1) * mib);
  const auto warns = [](const std::vector<std::string>& warnings, const std::string& part) {
    return std::any_of(warnings.begin(), warnings.end(),
                       [&](const std::string& w) { return w.find(part) != std::string::npos; });
  };
  EXPECT_TRUE(warns(segment.warnings, "large_segment_size_mb:17592186044414 is the largest value"));
  for (const char* key : {"max_non_split_rounding_mb", "pinned_reserve_segment_size_mb"}) {
    const auto w = allocator_config::parse(std::string(key) + ":18446744073709551615").warnings;
    EXPECT_TRUE(warns(w, std::string(key) + ":17592186044415 is the largest value")) << key;
  }
  // Just below the ceiling: no warning; above 2^64 - 1: out of range.
  EXPECT_TRUE(allocator_config::parse("max_split_size_mb:17592186044414").warnings.empty());
  EXPECT_TRUE(contains(parse_error("max_split_size_mb:18446744073709551616"), "is out of range"));
}

TEST(ConfigTest, ConfigKeysTable) {
  const auto& keys = config_keys();
  ASSERT_EQ(keys.size(), 22u);
  std::set<std::string_view> unique;
  for (const auto& info : keys) {
    EXPECT_FALSE(info.accepted.empty()) << info.key;
    EXPECT_FALSE(info.meaning.empty()) << info.key;
    unique.insert(info.key);
  }
  EXPECT_EQ(unique.size(), keys.size());
  EXPECT_EQ(keys.front().key, "max_split_size_mb");
}

// ---- bad values: message names key, value and what is accepted ---------------

struct bad_case {
  const char* text;
  const char* expected_message;  // exact
};

TEST(ConfigTest, BadValuesNameKeyValueAndAcceptedRange) {
  const std::vector<bad_case> cases = {
      {"max_split_size_mb:19",
       "ccalloc config: max_split_size_mb:19 is out of range: it is below "
       "large_segment_size_mb (20) (accepted: an integer number of MiB, at least "
       "large_segment_size_mb (20 by default))"},
      {"max_split_size_mb:-1",
       "ccalloc config: max_split_size_mb:-1 is not a valid value (accepted: an integer number "
       "of MiB, at least large_segment_size_mb (20 by default))"},
      {"max_split_size_mb:12abc",
       "ccalloc config: max_split_size_mb:12abc is not a valid value (accepted: an integer "
       "number of MiB, at least large_segment_size_mb (20 by default))"},
      {"max_split_size_mb:99999999999999999999999",
       "ccalloc config: max_split_size_mb:99999999999999999999999 is out of range (accepted: an "
       "integer number of MiB, at least large_segment_size_mb (20 by default))"},
      {"max_non_split_rounding_mb:10",
       "ccalloc config: max_non_split_rounding_mb:10 is out of range: it is below "
       "large_segment_size_mb (20) (accepted: an integer number of MiB, at least "
       "large_segment_size_mb (20 by default))"},
      {"large_segment_size_mb:10",
       "ccalloc config: large_segment_size_mb:10 is out of range (accepted: an even integer "
       "number of MiB greater than 10)"},
      {"large_segment_size_mb:13",
       "ccalloc config: large_segment_size_mb:13 is out of range (accepted: an even integer "
       "number of MiB greater than 10)"},
      {"garbage_collection_threshold:1.5",
       "ccalloc config: garbage_collection_threshold:1.5 is out of range (accepted: a number "
       "strictly between 0 and 1, i.e. in (0, 1))"},
      {"garbage_collection_threshold:0",
       "ccalloc config: garbage_collection_threshold:0 is out of range (accepted: a number "
       "strictly between 0 and 1, i.e. in (0, 1))"},
      {"garbage_collection_threshold:1",
       "ccalloc config: garbage_collection_threshold:1 is out of range (accepted: a number "
       "strictly between 0 and 1, i.e. in (0, 1))"},
      {"garbage_collection_threshold:half",
       "ccalloc config: garbage_collection_threshold:half is not a valid value (accepted: a "
       "number strictly between 0 and 1, i.e. in (0, 1))"},
      {"garbage_collection_threshold:nan",
       "ccalloc config: garbage_collection_threshold:nan is not a valid value (accepted: a "
       "number strictly between 0 and 1, i.e. in (0, 1))"},
      {"per_process_memory_fraction:1.01",
       "ccalloc config: per_process_memory_fraction:1.01 is out of range (accepted: a number "
       "in [0, 1])"},
      {"per_process_memory_fraction:-0.5",
       "ccalloc config: per_process_memory_fraction:-0.5 is out of range (accepted: a number "
       "in [0, 1])"},
      {"expandable_segments:yes",
       "ccalloc config: expandable_segments:yes is not a valid value (accepted: True or False "
       "(also true/false, 1/0))"},
      {"release_lock_on_cudamalloc:TRUE",
       "ccalloc config: release_lock_on_cudamalloc:TRUE is not a valid value (accepted: True "
       "or False (also true/false, 1/0))"},
      {"backend:cudaMalloc",
       "ccalloc config: backend:cudaMalloc is not a valid value (accepted: native or "
       "cudaMallocAsync)"},
      {"pinned_num_register_threads:3",
       "ccalloc config: pinned_num_register_threads:3 is out of range (accepted: a power of two "
       "in [1, 128])"},
      {"pinned_num_register_threads:256",
       "ccalloc config: pinned_num_register_threads:256 is out of range (accepted: a power of "
       "two in [1, 128])"},
      {"pinned_num_register_threads:0",
       "ccalloc config: pinned_num_register_threads:0 is out of range (accepted: a power of two "
       "in [1, 128])"},
      {"pinned_reserve_segment_size_mb:0",
       "ccalloc config: pinned_reserve_segment_size_mb:0 is out of range (accepted: an integer "
       "number of MiB greater than 0)"},
      {"pinned_use_background_threads:2",
       "ccalloc config: pinned_use_background_threads:2 is not a valid value (accepted: True or "
       "False (also true/false, 1/0))"},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(parse_error(c.text), c.expected_message) << c.text;
  }
}

TEST(ConfigTest, BadRoundupValuesExplainTheEntry) {
  const std::string accepted =
      " (accepted: 0 or a power of two, or a list [<MiB>:<d>,...,>:<d>] of increasing "
      "power-of-two sizes in MiB, optionally ending with >, each mapped to d = 0 or a power "
      "of two)";
  const std::string key = "ccalloc config: roundup_power2_divisions:";
  EXPECT_EQ(parse_error("roundup_power2_divisions:3"), key + "3 is out of range: divisions 3 is "
                                                             "not 0 or a power of two" + accepted);
  EXPECT_EQ(parse_error("roundup_power2_divisions:[300:1]"),
            key + "[300:1] is out of range: interval 300 is not a power of two (MiB)" + accepted);
  EXPECT_EQ(parse_error("roundup_power2_divisions:[256:3]"),
            key + "[256:3] is out of range: divisions 3 is not 0 or a power of two" + accepted);
  EXPECT_EQ(parse_error("roundup_power2_divisions:[256:1,512:2"),
            key + "[256:1,512:2 is not a valid value: missing the closing ']'" + accepted);
  EXPECT_EQ(parse_error("roundup_power2_divisions:[512:1,256:2]"),
            key + "[512:1,256:2] is out of range: interval 256 does not follow the previous one, 512 "
                  "(keys must increase)" + accepted);
  EXPECT_EQ(parse_error("roundup_power2_divisions:[>:4,256:2]"),
            key + "[>:4,256:2] is not a valid value: '>' must be the last entry" + accepted);
  EXPECT_EQ(parse_error("roundup_power2_divisions:[256:1,,>:2]"),
            key + "[256:1,,>:2] is not a valid value: empty list entry" + accepted);
  EXPECT_EQ(parse_error("roundup_power2_divisions:[256]"),
            key + "[256] is not a valid value: expected <MiB>:<divisions> or >:<divisions>, "
                  "got '256'" + accepted);
  EXPECT_EQ(parse_error("roundup_power2_divisions:[big:1]"),
            key + "[big:1] is not a valid value: interval 'big' is not a non-negative integer" +
                accepted);
  EXPECT_EQ(parse_error("roundup_power2_divisions:[256:x]"),
            key + "[256:x] is not a valid value: divisions 'x' is not a non-negative integer" +
                accepted);
  EXPECT_EQ(parse_error("roundup_power2_divisions:[[256:1]]"),
            key + "[[256:1]] is not a valid value: nested or stray brackets" + accepted);
  // Increasing keys, but both in the last interval: the message names the
  // bound and both keys, not the order.
  EXPECT_EQ(parse_error("roundup_power2_divisions:[32768:1,65536:2]"),
            key + "[32768:1,65536:2] is out of range: interval 65536 is past 32768, the start of the last "
                  "interval, which the key 32768 before it already set (sizes of 32768 MiB and above share "
                  "one interval: give one key of 32768 or more)" + accepted);
  EXPECT_EQ(parse_error("roundup_power2_divisions:[1024:1,65536:2,131072:4]"),
            key + "[1024:1,65536:2,131072:4] is out of range: interval 131072 is past 32768, the start of the "
                  "last interval, which the key 65536 before it already set (sizes of 32768 MiB and above "
                  "share one interval: give one key of 32768 or more)" + accepted);
  EXPECT_EQ(parse_error("roundup_power2_divisions:[256:1,256:2]"),
            key + "[256:1,256:2] is out of range: interval 256 does not follow the previous one, 256 "
                  "(keys must increase)" + accepted);
}

// ---- roundup_power2_divisions semantics ---------------------------------------

divisions_array roundup(const std::string& value) {
  return allocator_config::parse("roundup_power2_divisions:" + value).roundup_power2_divisions;
}

TEST(ConfigTest, RoundupListFromTheDocs) {
  // 256 MiB is interval 8: it and every interval below get 1; 512 MiB
  // (interval 9) gets 2; '>' fills 10..15 with 4.
  EXPECT_EQ(roundup("[256:1,512:2,>:4]"),
            (divisions_array{1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 4, 4, 4, 4, 4}));
}

TEST(ConfigTest, RoundupListLeavesUnlistedIntervalsAtZeroLikePyTorch) {
  // PyTorch (AcceleratorAllocatorConfig::parseRoundUpPower2Divisions) sets
  // only the listed intervals, the ones below the first key and the ones
  // after the last key ('>'); intervals between two keys stay 0.
  EXPECT_EQ(roundup("[64:8,256:4]"),
            (divisions_array{8, 8, 8, 8, 8, 8, 8, 0, 4, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(roundup("[64:8,128:2,256:4,512:2,1024:4,>:1]"),
            (divisions_array{8, 8, 8, 8, 8, 8, 8, 2, 4, 2, 4, 1, 1, 1, 1, 1}));
}

TEST(ConfigTest, RoundupListEdgeCases) {
  EXPECT_EQ(roundup("[]"), divisions_array{});
  EXPECT_EQ(roundup("0"), divisions_array{});
  EXPECT_EQ(roundup("[>:4]"), (divisions_array{4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4}));
  EXPECT_EQ(roundup("[1:2]"), (divisions_array{2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(roundup("[1:2,>:0]"), (divisions_array{2}));
  EXPECT_EQ(roundup("[32768:16]"),
            (divisions_array{16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16}));
  // Keys above 32768 MiB clamp to the last interval.
  EXPECT_EQ(roundup("[1024:2,65536:8]"),
            (divisions_array{2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 8}));
  // '>' right after the last interval fills nothing.
  EXPECT_EQ(roundup("[32768:2,>:8]"),
            (divisions_array{2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2}));
  // Divisions may be any power of two, as in PyTorch.
  EXPECT_EQ(roundup("1024")[15], 1024u);
}

TEST(ConfigTest, RoundupReplacesAllIntervalsOnApply) {
  auto config = allocator_config::parse("roundup_power2_divisions:8");
  config.apply("roundup_power2_divisions:[256:1]");
  EXPECT_EQ(config.roundup_power2_divisions,
            (divisions_array{1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0}));
}

TEST(ConfigTest, DivisionsForUsesPyTorchIndexing) {
  const auto config = allocator_config::parse(
      "roundup_power2_divisions:[1:1,2:2,4:4,8:8,16:16,32:32,64:64,128:128,256:256,512:512,"
      "1024:1024,2048:2048,4096:4096,8192:8192,16384:16384,32768:32768]");
  for (std::size_t i = 0; i < roundup_intervals; ++i) {
    EXPECT_EQ(config.roundup_power2_divisions[i], std::size_t{1} << i) << i;
  }
  EXPECT_EQ(config.divisions_for(0), 1u);
  EXPECT_EQ(config.divisions_for(1), 1u);
  EXPECT_EQ(config.divisions_for(512), 1u);
  EXPECT_EQ(config.divisions_for(mib - 1), 1u);
  EXPECT_EQ(config.divisions_for(mib), 1u);
  EXPECT_EQ(config.divisions_for(2 * mib - 1), 1u);
  EXPECT_EQ(config.divisions_for(2 * mib), 2u);
  EXPECT_EQ(config.divisions_for(256 * mib), 256u);
  EXPECT_EQ(config.divisions_for(512 * mib - 1), 256u);
  EXPECT_EQ(config.divisions_for(512 * mib), 512u);
  EXPECT_EQ(config.divisions_for(32 * gib - 1), 16384u);
  EXPECT_EQ(config.divisions_for(32 * gib), 32768u);
  EXPECT_EQ(config.divisions_for(1024 * gib), 32768u);
  EXPECT_EQ(config.divisions_for(unlimited), 32768u);
}

// ---- cross-key rules ----------------------------------------------------------

TEST(ConfigTest, LargeSegmentSizeSetsTheLowerBounds) {
  {
    const auto c = allocator_config::parse("expandable_segments:False,large_segment_size_mb:40");
    EXPECT_EQ(c.large_segment_size_bytes, 40 * mib);
    EXPECT_EQ(c.max_non_split_rounding_bytes, 40 * mib);
    EXPECT_TRUE(c.warnings.empty());
  }
  // Order does not matter: the bound is checked after every item.
  EXPECT_EQ(allocator_config::parse("max_split_size_mb:12,large_segment_size_mb:12")
                .max_split_size_bytes,
            12 * mib);
  EXPECT_EQ(parse_error("large_segment_size_mb:40,max_split_size_mb:30"),
            "ccalloc config: max_split_size_mb:30 is out of range: it is below "
            "large_segment_size_mb (40) (accepted: an integer number of MiB, at least "
            "large_segment_size_mb (20 by default))");
  EXPECT_EQ(parse_error("max_non_split_rounding_mb:30,large_segment_size_mb:40"),
            "ccalloc config: max_non_split_rounding_mb:30 is out of range: it is below "
            "large_segment_size_mb (40) (accepted: an integer number of MiB, at least "
            "large_segment_size_mb (20 by default))");
  // A bound from an earlier apply() is checked too, and the failed apply
  // changes nothing.
  auto config = allocator_config::parse("max_split_size_mb:32");
  const auto before = config;
  EXPECT_THROW(config.apply("large_segment_size_mb:64"), config_error);
  EXPECT_EQ(config, before);
}

// ---- apply() ------------------------------------------------------------------

TEST(ConfigTest, ApplyKeepsUnmentionedKeysAndIsTransactional) {
  auto config = allocator_config::parse("max_split_size_mb:128,expandable_segments:True");
  config.apply("garbage_collection_threshold:0.5,per_process_memory_fraction:0.9");
  EXPECT_EQ(config.max_split_size_bytes, 128 * mib);
  EXPECT_TRUE(config.expandable_segments);
  EXPECT_EQ(config.garbage_collection_threshold, 0.5);
  EXPECT_EQ(config.per_process_memory_fraction, 0.9);

  const auto before = config;
  // The first item is valid, the second is not: nothing is applied.
  EXPECT_THROW(config.apply("max_split_size_mb:256,garbage_collection_threshold:2"),
               config_error);
  EXPECT_EQ(config, before);
  EXPECT_THROW(config.apply("bogus:1"), config_error);
  EXPECT_EQ(config, before);
}

// ---- warnings (SPEC X6) -------------------------------------------------------

std::vector<std::string> warnings_of(const std::string& text) {
  return allocator_config::parse(text).warnings;
}

TEST(ConfigTest, ExpandableSegmentsAndOwnKeysGiveNoWarning) {
  EXPECT_TRUE(warnings_of("expandable_segments:True").empty());
  EXPECT_TRUE(warnings_of("expandable_segments:False,reuse_across_streams:False").empty());
  EXPECT_TRUE(warnings_of(ccalloc::pytorch_policies).empty());
}

TEST(ConfigTest, NoWarningsForEffectiveSettings) {
  EXPECT_TRUE(warnings_of("").empty());
  EXPECT_TRUE(warnings_of("max_split_size_mb:128,max_non_split_rounding_mb:64,"
                          "garbage_collection_threshold:0.6,per_process_memory_fraction:0.8,"
                          "roundup_power2_divisions:[256:1,512:2,>:4],expandable_segments:False,"
                          "release_lock_on_cudamalloc:True,large_segment_size_mb:24,"
                          "trim_on_new_peak:False")
                  .empty());
  // Compatibility keys at their defaults change nothing, so they do not warn.
  EXPECT_TRUE(warnings_of("backend:native,pinned_use_cuda_host_register:False,"
                          "pinned_num_register_threads:1,pinned_use_background_threads:False,"
                          "graph_capture_record_stream_reuse:False")
                  .empty());
  // max_non_split_rounding_mb equal to its default has no effect either way.
  EXPECT_TRUE(warnings_of("max_non_split_rounding_mb:20").empty());
}

// Settings that expandable segments (the default) or another setting make
// inert warn (SPEC X6; issue 16 looked for them after
// garbage_collection_threshold was found inert with expandable segments).
TEST(ConfigTest, SettingsInertInTheirConfigurationWarn) {
  {
    const auto w = warnings_of("large_segment_size_mb:40");
    ASSERT_EQ(w.size(), 1u);
    EXPECT_TRUE(contains(w[0], "large_segment_size_mb:40 has no effect with expandable segments")) << w[0];
  }
  {
    const auto w = warnings_of("expandable_segments:True,release_lock_on_cudamalloc:True");
    ASSERT_EQ(w.size(), 1u);
    EXPECT_TRUE(contains(w[0], "release_lock_on_cudamalloc:True has no effect with expandable segments")) << w[0];
  }
  {
    const auto w = warnings_of("expandable_segments:False,recycles_per_peak:8");
    ASSERT_EQ(w.size(), 1u);
    EXPECT_TRUE(contains(w[0], "recycles_per_peak:8 has no effect with expandable_segments:False")) << w[0];
  }
  {
    const auto w = warnings_of("expandable_segments:False,recycle_time_percent:50");
    ASSERT_EQ(w.size(), 1u);
    EXPECT_TRUE(contains(w[0], "recycle_time_percent:50 has no effect with expandable_segments:False")) << w[0];
  }
  {
    const auto w = warnings_of("trim_on_new_peak:False,recycles_per_peak:0");
    ASSERT_EQ(w.size(), 1u);
    EXPECT_TRUE(contains(w[0], "recycles_per_peak:0 has no effect with trim_on_new_peak:False")) << w[0];
  }
  // Where they act: no warning; garbage_collection_threshold acts with
  // expandable segments too (free pages are unmapped).
  EXPECT_TRUE(warnings_of("expandable_segments:False,large_segment_size_mb:40,release_lock_on_cudamalloc:True")
                  .empty());
  EXPECT_TRUE(warnings_of("recycles_per_peak:8").empty());
  EXPECT_TRUE(warnings_of("recycle_time_percent:50").empty());
  EXPECT_TRUE(warnings_of("expandable_segments:True,garbage_collection_threshold:0.5,per_process_memory_fraction:1")
                  .empty());
}

TEST(ConfigTest, GarbageCollectionWithoutFractionWarns) {
  const auto warnings = warnings_of("garbage_collection_threshold:0.6");
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_EQ(warnings[0],
            "ccalloc config: garbage_collection_threshold:0.6 is set without "
            "per_process_memory_fraction: PyTorch ignores the threshold then; ccalloc applies "
            "it to the device's total memory (set per_process_memory_fraction to choose the "
            "limit)");
  // Setting the fraction later (apply) removes the warning.
  auto config = allocator_config::parse("garbage_collection_threshold:0.6");
  config.apply("per_process_memory_fraction:1");
  EXPECT_TRUE(config.warnings.empty());
}

TEST(ConfigTest, IneffectiveSettingsWarnOncePerKey) {
  {
    const auto w = warnings_of("backend:cudaMallocAsync");
    ASSERT_EQ(w.size(), 1u);
    EXPECT_EQ(w[0],
              "ccalloc config: backend:cudaMallocAsync has no effect: ccalloc is a native-style "
              "caching allocator; the setting is ignored");
  }
  {
    const auto w = warnings_of("max_non_split_rounding_mb:64");
    ASSERT_EQ(w.size(), 1u);
    EXPECT_EQ(w[0],
              "ccalloc config: max_non_split_rounding_mb:64 has no effect without "
              "max_split_size_mb: no block is oversize, so none is rounded");
  }
  EXPECT_TRUE(warnings_of("max_non_split_rounding_mb:64,max_split_size_mb:256").empty());
  for (const char* text :
       {"pinned_use_cuda_host_register:True", "pinned_num_register_threads:8",
        "pinned_use_background_threads:True", "pinned_reserve_segment_size_mb:64"}) {
    const auto w = warnings_of(text);
    ASSERT_EQ(w.size(), 1u) << text;
    EXPECT_EQ(w[0], std::string("ccalloc config: ") + text +
                        " has no effect: pinned_* settings configure PyTorch's pinned host "
                        "memory allocator, not device memory");
  }
  {
    const auto w = warnings_of("graph_capture_record_stream_reuse:True");
    ASSERT_EQ(w.size(), 1u);
    EXPECT_TRUE(contains(w[0], "graph_capture_record_stream_reuse:True has no effect"));
  }
  // All of them at once: one warning each, in table order.
  const auto all = warnings_of(
      "graph_capture_record_stream_reuse:True,pinned_reserve_segment_size_mb:8,"
      "pinned_use_background_threads:True,pinned_num_register_threads:2,"
      "pinned_use_cuda_host_register:True,backend:cudaMallocAsync,max_non_split_rounding_mb:30,"
      "garbage_collection_threshold:0.5");
  ASSERT_EQ(all.size(), 8u);
  EXPECT_TRUE(contains(all[0], "garbage_collection_threshold:0.5"));
  EXPECT_TRUE(contains(all[1], "max_non_split_rounding_mb:30"));
  EXPECT_TRUE(contains(all[2], "backend:cudaMallocAsync"));
  EXPECT_TRUE(contains(all[7], "graph_capture_record_stream_reuse:True"));
}

// ---- to_string() round trips ----------------------------------------------------

TEST(ConfigTest, ToStringRoundTrips) {
  const std::vector<std::string> texts = {
      "",
      "max_split_size_mb:128",
      "max_split_size_mb:20,max_non_split_rounding_mb:512,large_segment_size_mb:20",
      "large_segment_size_mb:12,max_split_size_mb:12",
      "large_segment_size_mb:64",
      "garbage_collection_threshold:0.1",
      "garbage_collection_threshold:0.30000000000000004,per_process_memory_fraction:0.123456789",
      "per_process_memory_fraction:0",
      "per_process_memory_fraction:1",
      "roundup_power2_divisions:4",
      "roundup_power2_divisions:[256:1,512:2,>:4]",
      "roundup_power2_divisions:[64:8,256:4]",
      "roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]",
      "roundup_power2_divisions:[1:2]",
      "roundup_power2_divisions:[2:1,32768:2]",
      "roundup_power2_divisions:[1024:2,65536:8]",
      "expandable_segments:True,release_lock_on_cudamalloc:true",
      "trim_on_new_peak:False",
      "backend:cudaMallocAsync",
      "pinned_use_cuda_host_register:True,pinned_num_register_threads:128,"
      "pinned_use_background_threads:1,pinned_reserve_segment_size_mb:1024,"
      "graph_capture_record_stream_reuse:True",
      "max_split_size_mb:99999999999999999",
      "max_split_size_mb:4096,max_non_split_rounding_mb:64,large_segment_size_mb:32,"
      "garbage_collection_threshold:0.75,roundup_power2_divisions:[128:4,>:16],"
      "expandable_segments:True,release_lock_on_cudamalloc:True,"
      "per_process_memory_fraction:0.5,backend:native",
  };
  for (const auto& text : texts) {
    const auto original = allocator_config::parse(text);
    const auto printed = original.to_string();
    const auto reparsed = allocator_config::parse(printed);
    EXPECT_EQ(reparsed, original) << text << " -> " << printed;
    EXPECT_EQ(reparsed.to_string(), printed) << text;
  }
}

TEST(ConfigTest, ToStringCanonicalForms) {
  EXPECT_TRUE(contains(allocator_config::parse("roundup_power2_divisions:[256:1,512:2,>:4]")
                           .to_string(),
                       "roundup_power2_divisions:[256:1,512:2,>:4]"));
  EXPECT_TRUE(contains(allocator_config::parse("roundup_power2_divisions:[64:8,256:4]")
                           .to_string(),
                       "roundup_power2_divisions:[64:8,128:0,256:4,>:0]"));
  const auto full = allocator_config::parse(
                        "max_split_size_mb:256,garbage_collection_threshold:0.6,"
                        "per_process_memory_fraction:0.8,pinned_reserve_segment_size_mb:16")
                        .to_string();
  EXPECT_EQ(full,
            "max_split_size_mb:256,max_non_split_rounding_mb:20,large_segment_size_mb:20,"
            "garbage_collection_threshold:0.6,roundup_power2_divisions:0,"
            "release_lock_on_cudamalloc:False,"
            "per_process_memory_fraction:0.8,trim_on_new_peak:True,reuse_across_streams:True,"
            "reuse_with_stream_wait:False,backend:native,"
            "pinned_use_cuda_host_register:False,pinned_num_register_threads:1,"
            "pinned_use_background_threads:False,pinned_reserve_segment_size_mb:16,"
            "graph_capture_record_stream_reuse:False");
}

// ---- CCALLOC_CONF ---------------------------------------------------------------

TEST(ConfigTest, FromEnvironment) {
  {
    scoped_env env("CCALLOC_CONF", nullptr);
    EXPECT_EQ(allocator_config::from_environment(), allocator_config{});
  }
  {
    scoped_env env("CCALLOC_CONF", "max_split_size_mb:64,expandable_segments:True");
    const auto config = allocator_config::from_environment();
    EXPECT_EQ(config.max_split_size_bytes, 64 * mib);
    EXPECT_TRUE(config.expandable_segments);
  }
  {
    scoped_env env("CCALLOC_CONF", "garbage_collection_threshold:1.5");
    try {
      (void)allocator_config::from_environment();
      ADD_FAILURE() << "no exception";
    } catch (const config_error& e) {
      EXPECT_EQ(std::string(e.what()),
                "ccalloc config (CCALLOC_CONF): garbage_collection_threshold:1.5 is out of "
                "range (accepted: a number strictly between 0 and 1, i.e. in (0, 1))");
    }
  }
}

}  // namespace
}  // namespace ccalloc
