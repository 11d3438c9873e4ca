// The recycling time budget (src/core/detail/recycle_budget.hpp): a token
// bucket of host microseconds with a reserve for large peaks.
#include "../src/core/detail/recycle_budget.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>

namespace {

using ccalloc::detail::recycle_budget;
using source = recycle_budget::source;

struct fake_clock {
  std::optional<std::uint64_t> now_us;
  int reads = 0;
  std::optional<std::uint64_t> operator()() {
    ++reads;
    return now_us;
  }
};

TEST(RecycleBudget, FullAtTheFirstRefillThenSpentAndRefilledAtThePercent) {
  recycle_budget b;
  fake_clock clock{1'000};
  EXPECT_EQ(b.choose(5, false, clock), source::bucket);
  EXPECT_DOUBLE_EQ(b.tokens_us(), 50'000.0);    // 5 % of one second
  EXPECT_DOUBLE_EQ(b.reserve_us(), 500'000.0);  // 5 % of ten seconds
  b.spend(source::bucket, 5, 120'000.0);        // past empty: a debt, bounded by one depth
  EXPECT_DOUBLE_EQ(b.tokens_us(), -50'000.0);
  clock.now_us = 1'000 + 600'000;  // 5 % of 0.6 s = 30 ms back
  EXPECT_EQ(b.choose(5, false, clock), source::none);
  EXPECT_DOUBLE_EQ(b.tokens_us(), -20'000.0);
  EXPECT_DOUBLE_EQ(b.reserve_us(), 500'000.0);  // the bucket was not full: nothing spilled
}

TEST(RecycleBudget, ReservePaysOnlyLargePeaksAndFillsWithWhatTheFullBucketCannotHold) {
  recycle_budget b;
  fake_clock clock{0};
  ASSERT_EQ(b.choose(10, false, clock), source::bucket);
  b.spend(source::bucket, 10, 100'000.0);  // empty
  b.spend(source::reserve, 10, 999'000.0);  // 1 ms left in the reserve
  EXPECT_EQ(b.choose(10, false, clock), source::none);
  EXPECT_EQ(b.choose(10, true, clock), source::reserve);
  clock.now_us = 2'000'000;  // 200 ms at 10 %: 100 ms fill the bucket, 100 ms spill
  EXPECT_EQ(b.choose(10, true, clock), source::bucket);
  EXPECT_DOUBLE_EQ(b.tokens_us(), 100'000.0);
  EXPECT_DOUBLE_EQ(b.reserve_us(), 101'000.0);
  EXPECT_TRUE(b.within_bounds(10));
}

TEST(RecycleBudget, ClockReadOnlyBetweenOneAndNinetyNinePercent) {
  recycle_budget b;
  fake_clock clock{5};
  EXPECT_EQ(b.choose(100, true, clock), source::bucket);
  EXPECT_EQ(b.choose(0, true, clock), source::none);
  EXPECT_EQ(clock.reads, 0);
  clock.now_us = std::nullopt;  // no clock: no budget
  EXPECT_EQ(b.choose(50, false, clock), source::bucket);
  EXPECT_EQ(clock.reads, 1);
}

TEST(RecycleBudget, LoweredPercentBoundsWhatIsLeftAndTheDebtAtTheNextRefill) {
  recycle_budget b;
  b.refill(50, 0);
  EXPECT_DOUBLE_EQ(b.tokens_us(), 500'000.0);
  EXPECT_FALSE(b.within_bounds(1));
  b.refill(1, 0);  // the clock has not moved: bounded all the same
  EXPECT_DOUBLE_EQ(b.tokens_us(), 10'000.0);
  EXPECT_DOUBLE_EQ(b.reserve_us(), 100'000.0);
  EXPECT_TRUE(b.within_bounds(1));
  b.refill(1, 0);
  b.spend(source::none, 1, 1e9);  // none pays nothing
  EXPECT_DOUBLE_EQ(b.tokens_us(), 10'000.0);
}

TEST(RecycleBudget, AnEarlierReadingAddsNothing) {
  recycle_budget b;
  b.refill(10, 1'000'000);
  b.spend(source::bucket, 10, 50'000.0);
  b.refill(10, 500'000);  // the clock went back
  EXPECT_DOUBLE_EQ(b.tokens_us(), 50'000.0);
  b.refill(10, 1'100'000);  // only the time after the latest reading counts
  EXPECT_DOUBLE_EQ(b.tokens_us(), 60'000.0);
}

}  // namespace
