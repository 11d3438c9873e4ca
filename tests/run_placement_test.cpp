// Placement of a request that maps pages (src/core/detail/run_placement.hpp):
// consider_run keeps the run with the fewest pages to map, then the shortest;
// an idle reservation of another stream only when it saves pages.
#include "../src/core/detail/run_placement.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace {

using ccalloc::detail::block;
using ccalloc::detail::run_choice;
using ccalloc::detail::segment;

constexpr std::size_t page = 2u << 20;

// An expandable segment of `pages` pages whose blocks are `sizes` (in
// pages), each allocated, free mapped or free unmapped as `kinds` says
// ('a', 'f', 'u'); pages under 'a' and 'f' are mapped.
struct test_segment {
  test_segment(std::uint64_t seq, std::uintptr_t base, const std::vector<std::size_t>& sizes, const char* kinds)
      : blocks(sizes.size()) {
    seg.expandable = true;
    seg.seq = seq;
    seg.base = base;
    seg.page_bytes = page;
    std::size_t pages = 0;
    for (std::size_t n : sizes) pages += n;
    seg.size = pages * page;
    seg.pages.reset(pages);
    std::uintptr_t at = base;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      block& b = blocks[i];
      b.ptr = at;
      b.size = sizes[i] * page;
      b.seg = &seg;
      b.allocated = kinds[i] == 'a';
      b.mapped = kinds[i] != 'u';
      b.prev = i > 0 ? &blocks[i - 1] : nullptr;
      b.next = i + 1 < sizes.size() ? &blocks[i + 1] : nullptr;
      if (b.mapped)
        for (std::size_t p = (at - base) / page; p < (at - base) / page + sizes[i]; ++p) seg.pages.set_mapped(p, 1);
      at += b.size;
    }
    seg.head = &blocks[0];
  }
  segment seg;
  std::vector<block> blocks;
};

TEST(RunPlacement, FewestPagesToMapWinThenTheShortestRun) {
  // [a 1][f 1][u 2][a 1][f 3][a 1]: runs {f,u} of 3 pages (2 to map) and {f} of 3 (none to map).
  test_segment s(1, 0x100000000, {1, 1, 2, 1, 3, 1}, "afuafa");
  run_choice best;
  ccalloc::detail::scan_runs(best, s.seg, false, 2 * page);
  ASSERT_EQ(best.seg, &s.seg);
  EXPECT_EQ(best.first, &s.blocks[4]);
  EXPECT_EQ(best.pages, 0u);
  EXPECT_EQ(best.run, 3 * page);
  // A request of 1 page: both runs map nothing and are 3 pages long; the
  // lower offset wins.
  run_choice one;
  ccalloc::detail::scan_runs(one, s.seg, false, page);
  EXPECT_EQ(one.first, &s.blocks[1]);
  EXPECT_EQ(one.pages, 0u);
  // Too large for every run: nothing chosen.
  run_choice none;
  ccalloc::detail::scan_runs(none, s.seg, false, 4 * page);
  EXPECT_EQ(none.seg, nullptr);
}

TEST(RunPlacement, AnIdleReservationOfAnotherStreamOnlyWhenItSavesPages) {
  test_segment own(1, 0x100000000, {1, 4}, "au");   // 4 unmapped pages after a live block
  test_segment idle(2, 0x200000000, {4}, "u");      // all unmapped: saves nothing
  test_segment mapped(3, 0x300000000, {4}, "f");    // all mapped: saves every page
  run_choice best;
  ccalloc::detail::scan_runs(best, own.seg, false, 2 * page);
  ASSERT_EQ(best.seg, &own.seg);
  EXPECT_EQ(best.pages, 2u);
  ccalloc::detail::scan_runs(best, idle.seg, true, 2 * page);
  EXPECT_EQ(best.seg, &own.seg);  // adopting would map as many pages
  ccalloc::detail::scan_runs(best, mapped.seg, true, 2 * page);
  EXPECT_EQ(best.seg, &mapped.seg);
  EXPECT_TRUE(best.foreign);
  EXPECT_EQ(best.pages, 0u);
}

}  // namespace
