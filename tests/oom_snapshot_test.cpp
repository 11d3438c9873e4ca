// oom_snapshot_test.cpp: the snapshot written at an out-of-memory error
// (config keys oom_snapshot, oom_snapshot_interval_s; src/core/out_of_memory.cpp)
// and the snapshot pickle writer (to_pickle, include/ccalloc/core/snapshot.hpp),
// on the simulated device.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/history.hpp>
#include <ccalloc/core/snapshot.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>
#include <ccalloc/replay/trace.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <chrono>
#include <filesystem>
#include <future>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace {

using namespace ccalloc;  // NOLINT: test file
namespace fs = std::filesystem;

struct fixture {
  explicit fixture(const std::string& conf) : sim(std::make_shared<sim_backend>(options())),
                                              alloc(sim, allocator_config::parse(conf)) {
    alloc.init(sim->device_count());
  }
  static sim_options options() {
    sim_options o;
    o.capacity_bytes = 64 * mib;
    return o;
  }
  /// The message of the out-of-memory error of a 100 MiB request.
  std::string oom_message() {
    try {
      (void)alloc.malloc(0, 100 * mib, 0);
    } catch (const out_of_memory_error& e) {
      return e.what();
    }
    ADD_FAILURE() << "no out-of-memory error";
    return {};
  }
  std::shared_ptr<sim_backend> sim;
  caching_allocator alloc;
};

/// A fresh path in a fresh directory under the test's temporary directory.
std::string temp_path(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("ccalloc-oom-snapshot-" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return (dir / "oom.pickle").string();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

/// The names in `dir`, sorted.
std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(OomSnapshot, WrittenOnceBeforeTheErrorWhichSaysWhere) {
  const std::string path = temp_path("once");
  fixture f("expandable_segments:False,oom_snapshot:" + path);
  f.alloc.record_history({});
  void* live = f.alloc.malloc(0, 30 * mib, 0);
  const std::string first = f.oom_message();
  EXPECT_TRUE(contains(first, "ccalloc: out of memory on device 0")) << first;
  EXPECT_TRUE(contains(first, "A snapshot of device 0's memory (oom_snapshot) was written to " + path + "."))
      << first;
  const std::string bytes = read_file(path);
  ASSERT_GT(bytes.size(), 2u);
  EXPECT_EQ(bytes.substr(0, 2), std::string("\x80\x02", 2)) << "a pickle, protocol 2";
  EXPECT_EQ(bytes.back(), '.') << "ends with STOP";
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  // Within oom_snapshot_interval_s (60 s by default): the error is raised,
  // no file written, and the message says why.
  fs::remove(path);
  const std::string second = f.oom_message();
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(contains(second, "No snapshot was written (oom_snapshot): the last one went to " + path))
      << second;
  EXPECT_TRUE(contains(second, "oom_snapshot_interval_s is 60.")) << second;
  EXPECT_EQ(f.alloc.get_device_stats(0).num_ooms, 2);
  f.alloc.free(live);
}

TEST(OomSnapshot, ReadableByTheReportReaderWithTheHistory) {
  const std::string path = temp_path("readable");
  fixture f("expandable_segments:False,oom_snapshot:" + path);
  f.alloc.record_history({});
  void* a = f.alloc.malloc(0, 4 * mib, 0);
  void* b = f.alloc.malloc(0, 1000, 0);
  f.alloc.free(b);
  (void)f.oom_message();
  trace t;
  try {
    t = read_trace_file(path);  // what `ccalloc report` and `ccalloc replay` read
  } catch (const trace_error& e) {
    if (contains(e.what(), "python3")) GTEST_SKIP() << "no python3 to convert snapshots: " << e.what();
    throw;
  }
  std::vector<std::string> seen;
  for (const trace_event& e : t.events) seen.emplace_back(to_string(e.action));
  // alloc 4 MiB, alloc 1000, free_requested + free_completed 1000, oom 100 MiB.
  const std::vector<std::string> want = {"alloc", "alloc", "free_requested", "free_completed", "oom"};
  std::vector<std::string> got;
  for (const std::string& s : seen)
    if (s == "alloc" || s == "free_requested" || s == "free_completed" || s == "oom") got.push_back(s);
  EXPECT_EQ(got, want);
  for (const trace_event& e : t.events) {
    if (to_string(e.action) == "oom") {
      EXPECT_EQ(e.size, 100 * mib);
    }
  }
  f.alloc.free(a);
}

TEST(OomSnapshot, IntervalZeroWritesEveryTime) {
  const std::string path = temp_path("every");
  fixture f("expandable_segments:False,oom_snapshot_interval_s:0,oom_snapshot:" + path);
  for (int i = 0; i < 3; ++i) {
    fs::remove(path);
    const std::string m = f.oom_message();
    EXPECT_TRUE(fs::exists(path)) << i;
    EXPECT_TRUE(contains(m, "was written to " + path)) << m;
  }
}

TEST(OomSnapshot, AFailedWriteStillRaisesTheErrorAndSaysWhy) {
  const std::string path = temp_path("fails") + ".missing/oom.pickle";  // its directory does not exist
  fixture f("expandable_segments:False,oom_snapshot:" + path);
  const std::string m = f.oom_message();
  EXPECT_TRUE(contains(m, "The snapshot (oom_snapshot) could not be written to " + path +
                              ": cannot create a temporary file in " + fs::path(path).parent_path().string() +
                              " (No such file or directory).")) << m;
  EXPECT_FALSE(fs::exists(path));
  // The allocator still works.
  f.alloc.free(f.alloc.malloc(0, mib, 0));
}

// A path that is not a regular file (a device, a FIFO) is written in place:
// a temporary file renamed over it would replace the node itself (as root,
// oom_snapshot:/dev/full replaced the device with a file). A symbolic link
// (dangling here) stays: the snapshot replaces the file it leads to.
TEST(OomSnapshot, APathThatIsNoRegularFileIsWrittenInPlaceNotReplaced) {
  const std::string target = temp_path("link-target");
  const std::string link = temp_path("link");
  fs::remove(target);
  fs::remove(link);
  fs::create_symlink(target, link);
  {
    fixture f("expandable_segments:False,oom_snapshot:" + link);
    const std::string m = f.oom_message();
    EXPECT_TRUE(contains(m, "was written to " + link)) << m;
  }
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(link))) << "the link was replaced by a file";
  EXPECT_GT(fs::file_size(target), 0u);  // the snapshot went through the link
  EXPECT_EQ(names_in(fs::path(link).parent_path()), std::vector<std::string>{"oom.pickle"});
  EXPECT_EQ(names_in(fs::path(target).parent_path()), std::vector<std::string>{"oom.pickle"});
  fs::remove(link);
  fs::remove(target);
  {
    fixture f("expandable_segments:False,oom_snapshot:/dev/null");
    const std::string m = f.oom_message();
    EXPECT_TRUE(contains(m, "was written to /dev/null")) << m;
  }
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
  EXPECT_FALSE(fs::exists("/dev/null.tmp"));
}

// A FIFO with no reader is not waited for: the malloc that ran out of
// memory gets its error at once, saying why there is no snapshot. (It
// waited forever in open.) A reader opened after 10 s frees a writer that
// waits, so that the test fails rather than hangs.
TEST(OomSnapshot, AFifoWithNoReaderIsNotWaitedFor) {
  const std::string fifo = temp_path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  fixture f("expandable_segments:False,oom_snapshot:" + fifo);
  std::promise<std::string> message;
  std::future<std::string> done = message.get_future();
  std::thread writer([&] { message.set_value(f.oom_message()); });
  if (done.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "the out-of-memory error waited for a reader of " << fifo;
    const int reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
    done.wait();
    if (reader >= 0) ::close(reader);
  }
  writer.join();
  const std::string m = done.get();
  EXPECT_TRUE(contains(m, " The snapshot (oom_snapshot) could not be written to " + fifo +
                              ": a FIFO with no reader (No such device or address).")) << m;
}

// The temporary file is one no one else has: a user's file beside the path
// (named as a fixed temporary name would be) is neither written nor moved,
// nothing is left behind, and the snapshot gets a new file's mode.
TEST(OomSnapshot, AUsersFileBesideThePathIsNeitherWrittenNorMoved) {
  const std::string path = temp_path("beside");
  for (const std::string& name : {path + ".tmp", path + ".tmp.0", path + ".XXXXXX"}) {
    std::ofstream(name) << "precious";
  }
  {
    fixture f("expandable_segments:False,oom_snapshot:" + path);
    const std::string m = f.oom_message();
    EXPECT_TRUE(contains(m, "was written to " + path + ".")) << m;
  }
  for (const std::string& name : {path + ".tmp", path + ".tmp.0", path + ".XXXXXX"}) {
    EXPECT_EQ(read_file(name), "precious") << name;
  }
  EXPECT_EQ(read_file(path).substr(0, 2), std::string("\x80\x02", 2));
  EXPECT_EQ(names_in(fs::path(path).parent_path()),
            (std::vector<std::string>{"oom.pickle", "oom.pickle.XXXXXX", "oom.pickle.tmp", "oom.pickle.tmp.0"}));
  const mode_t mask = ::umask(0);
  ::umask(mask);
  EXPECT_EQ(static_cast<unsigned>(fs::status(path).permissions()), 0666u & ~mask);
}

// A snapshot file there keeps its permissions, and a read-only one is not
// replaced (fopen would not write it either), unless run as root.
TEST(OomSnapshot, AReplacedFileKeepsItsModeAndAReadOnlyOneStays) {
  const std::string path = temp_path("mode");
  std::ofstream(path) << "old";
  fs::permissions(path, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  {
    fixture f("expandable_segments:False,oom_snapshot:" + path);
    const std::string m = f.oom_message();
    EXPECT_TRUE(contains(m, "was written to " + path + ".")) << m;
  }
  EXPECT_EQ(fs::status(path).permissions(), fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  EXPECT_EQ(read_file(path).substr(0, 2), std::string("\x80\x02", 2));
  if (::geteuid() == 0) GTEST_SKIP() << "root writes read-only files";
  std::ofstream(path, std::ios::trunc) << "read-only";
  fs::permissions(path, fs::perms::owner_read);
  {
    fixture f("expandable_segments:False,oom_snapshot:" + path);
    const std::string m = f.oom_message();
    EXPECT_TRUE(contains(m, "could not be written to " + path + " (Permission denied).")) << m;
  }
  EXPECT_EQ(read_file(path), "read-only");
  EXPECT_EQ(fs::status(path).permissions(), fs::perms::owner_read);
}

// Writers on several devices at once (oom_snapshot_interval_s:0) each write
// their own temporary file: every message says the snapshot was written,
// the file is a whole pickle, and no temporary file stays.
TEST(OomSnapshot, WritersOnSeveralDevicesAtOnceEachSayTheTruth) {
  const std::string path = temp_path("concurrent");
  sim_options o;
  o.capacity_bytes = 64 * mib;
  o.device_count = 2;
  auto sim = std::make_shared<sim_backend>(o);
  caching_allocator alloc(sim, allocator_config::parse("expandable_segments:False,oom_snapshot_interval_s:0,"
                                                       "oom_snapshot:" + path));
  alloc.init(sim->device_count());
  std::atomic<int> written{0};
  std::atomic<int> other{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 10; ++i) {
        try {
          (void)alloc.malloc(t % 2, 100 * mib, 0);
        } catch (const out_of_memory_error& e) {
          (contains(e.what(), "was written to " + path + ".") ? written : other)++;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(written.load(), 40);
  EXPECT_EQ(other.load(), 0);
  const std::string bytes = read_file(path);
  ASSERT_GT(bytes.size(), 2u);
  EXPECT_EQ(bytes.substr(0, 2), std::string("\x80\x02", 2));
  EXPECT_EQ(bytes.back(), '.');
  EXPECT_EQ(names_in(fs::path(path).parent_path()), std::vector<std::string>{"oom.pickle"});
}

TEST(OomSnapshot, OffByDefault) {
  fixture f("expandable_segments:False");
  const std::string m = f.oom_message();
  EXPECT_FALSE(contains(m, "snapshot")) << m;
}

TEST(Snapshot, PickleEncodesEveryKindOfValue) {
  memory_snapshot s;
  segment_info seg;
  seg.address = 0x7f0000000000;  // needs LONG1 (> 2^31)
  seg.total_bytes = 2 * mib;
  seg.pool = {1, 0};
  block_info b;
  b.address = seg.address;
  b.size_bytes = 2 * mib;
  b.state = block_state::active_allocated;
  auto context = std::make_shared<trace_context>();
  context->frames.push_back({"f", "x.py", 7});
  b.context = context;
  seg.blocks.push_back(b);
  s.segments.push_back(seg);
  s.device_traces.resize(1);
  const std::string p = to_pickle(s);
  EXPECT_EQ(p.substr(0, 3), std::string("\x80\x02}", 3));
  // 0x7f0000000000 as LONG1: 6 bytes little-endian (the top byte 0x7f has its high bit clear).
  EXPECT_TRUE(contains(p, std::string("\x8a\x06\x00\x00\x00\x00\x00\x7f", 8)));
  // segment_pool_id as a tuple: MARK, BININT 1, BININT 0, TUPLE.
  EXPECT_TRUE(contains(p, std::string("(J\x01\x00\x00\x00J\x00\x00\x00\x00t", 12)));
  // A frame's strings as BINUNICODE.
  EXPECT_TRUE(contains(p, std::string("X\x04\x00\x00\x00x.py", 9)));
  // garbage_collection_threshold 0.0 as BINFLOAT, per_process_memory_fraction 1.0.
  EXPECT_TRUE(contains(p, std::string("G\x3f\xf0\x00\x00\x00\x00\x00\x00", 9)));
  EXPECT_EQ(p.back(), '.');
}

}  // namespace
