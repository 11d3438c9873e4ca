// Page fences of one stream (src/core/detail/page_fences.hpp) against a
// scripted device: which events are recorded, polled, waited on, and the
// count each fence covers.
#include "../src/core/detail/page_fences.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <stdexcept>
#include <vector>

namespace {

using ccalloc::event_t;
using ccalloc::stream_t;
using ccalloc::detail::page_fences;
using reason = page_fences::wait_reason;

// Events complete when the test says so (done); records and waits are logged.
struct scripted_device final : page_fences::device {
  event_t next = 100;
  std::vector<event_t> pool;  // given back
  std::set<event_t> done;
  std::vector<std::pair<event_t, stream_t>> records;
  std::vector<event_t> synchronized;
  int device_syncs = 0;
  bool fail_record = false;

  event_t take_event() override {
    if (!pool.empty()) {
      const event_t e = pool.back();
      pool.pop_back();
      return e;
    }
    return next++;
  }
  void give_event(event_t e) override { pool.push_back(e); }
  bool query(event_t e) override { return done.count(e) != 0; }
  void record(event_t e, stream_t s) override {
    if (fail_record) throw std::runtime_error("record failed");
    done.erase(e);
    records.emplace_back(e, s);
  }
  void synchronize(event_t e) override {
    synchronized.push_back(e);
    done.insert(e);
  }
  void synchronize_device() override { ++device_syncs; }
};

constexpr stream_t s7 = 7;

TEST(PageFencesUnit, CompletedRecordsWhereNoneCoversAndPollsWithoutBlocking) {
  scripted_device d;
  page_fences f;
  EXPECT_FALSE(f.completed(d, s7, 3, 5, /*may_record=*/false));  // none recorded, may not record
  EXPECT_TRUE(d.records.empty());
  EXPECT_FALSE(f.completed(d, s7, 3, 5, true));  // records one covering 5, not yet done
  ASSERT_EQ(d.records.size(), 1u);
  EXPECT_EQ(d.records[0], (std::pair<event_t, stream_t>{100, s7}));
  EXPECT_EQ(f.recorded_up_to(), 5u);
  EXPECT_EQ(f.completed_up_to(), 0u);
  EXPECT_FALSE(f.completed(d, s7, 4, 5, true));  // covered: no second record
  EXPECT_EQ(d.records.size(), 1u);
  d.done.insert(100);
  EXPECT_TRUE(f.completed(d, s7, 5, 6, true));
  EXPECT_EQ(f.completed_up_to(), 5u);
  EXPECT_TRUE(f.empty());
  EXPECT_EQ(d.pool, std::vector<event_t>{100});  // the event went back to the pool
  EXPECT_TRUE(f.check());
}

TEST(PageFencesUnit, PastMaxOutstandingTheNewestIsRecordedAgain) {
  scripted_device d;
  page_fences f;
  for (std::uint64_t c = 1; c <= page_fences::max_outstanding + 2; ++c) f.record(d, s7, c * 10);
  ASSERT_EQ(f.outstanding().size(), page_fences::max_outstanding);
  EXPECT_EQ(f.outstanding().back().covers, (page_fences::max_outstanding + 2) * 10);
  EXPECT_EQ(f.outstanding().back().event, d.records[page_fences::max_outstanding - 1].first);
  EXPECT_EQ(d.records.size(), page_fences::max_outstanding + 2);
  EXPECT_TRUE(f.check());
  d.done.insert(f.outstanding()[0].event);
  d.done.insert(f.outstanding()[2].event);  // out of order: the poll stops at the first not done
  f.poll(d);
  EXPECT_EQ(f.completed_up_to(), 10u);
  EXPECT_EQ(f.outstanding().size(), page_fences::max_outstanding - 1);
}

TEST(PageFencesUnit, WaitCountsByReasonAndFallsBackToTheDevice) {
  scripted_device d;
  page_fences f;
  EXPECT_FALSE(f.wait(d, s7, 0, true, reason::reclaim_pages));  // nothing freed: no wait
  f.record(d, s7, 4);
  EXPECT_TRUE(f.wait(d, s7, 4, true, reason::deferred_unmap));  // the newest covers it
  EXPECT_EQ(d.synchronized, std::vector<event_t>{100});
  EXPECT_EQ(f.completed_up_to(), 4u);
  EXPECT_TRUE(f.wait(d, s7, 6, true, reason::deferred_unmap));  // records one, waits on it
  EXPECT_EQ(d.records.size(), 2u);
  EXPECT_EQ(f.completed_up_to(), 6u);
  EXPECT_TRUE(f.wait(d, s7, 9, false, reason::garbage_collection));  // may not record: whole device
  EXPECT_EQ(d.device_syncs, 1);
  EXPECT_EQ(f.completed_up_to(), 9u);
  EXPECT_EQ(f.waits(reason::reclaim_pages), 0u);
  EXPECT_EQ(f.waits(reason::deferred_unmap), 2u);
  EXPECT_EQ(f.waits(reason::garbage_collection), 1u);
  EXPECT_EQ(f.waits(reason::adopt_segment), 0u);
}

TEST(PageFencesUnit, CoveringFindsTheOldestThatCoversAndAFailedRecordChangesNothing) {
  scripted_device d;
  page_fences f;
  f.record(d, s7, 3);
  f.record(d, s7, 8);
  const auto c = f.covering(d, s7, 5, 8, false);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->event, 101u);
  EXPECT_EQ(c->covers, 8u);
  EXPECT_FALSE(f.covering(d, s7, 9, 9, false).has_value());  // none covers, may not record
  d.fail_record = true;
  EXPECT_THROW(f.covering(d, s7, 9, 9, true), std::runtime_error);
  EXPECT_EQ(f.outstanding().size(), 2u);
  EXPECT_EQ(d.pool, std::vector<event_t>{102});  // the new event went back
  f.all_completed(9);
  EXPECT_EQ(f.completed_up_to(), 9u);
  std::vector<event_t> dropped;
  f.drop_outstanding([&](event_t e) { dropped.push_back(e); });
  EXPECT_EQ(dropped, (std::vector<event_t>{100, 101}));
  EXPECT_TRUE(f.empty());
}

}  // namespace
