// The page table of an expandable segment (src/core/detail/page_table.hpp):
// mapped, unmapped and retired pages, and the retired pages' order.
#include "../src/core/detail/page_table.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <vector>

namespace {

using ccalloc::detail::page_table;

std::vector<std::size_t> retired_indices(const page_table& t) {
  std::vector<std::size_t> out;
  for (const auto& r : t.retired()) out.push_back(r.index);
  return out;
}

TEST(PageTable, PagesAreMappedUnmappedOrRetired) {
  page_table t;
  t.reset(8);
  EXPECT_EQ(t.count(), 8u);
  t.set_mapped(2, 42);
  t.set_mapped(5, 43);
  EXPECT_TRUE(t.mapped(2));
  EXPECT_EQ(t.handle(5), 43u);
  EXPECT_FALSE(t.mapped(3));
  EXPECT_TRUE(t.check());
  // Page 5 moves on before its stream's work has run: retired.
  t.reserve_retired(1);
  t.retire({5, t.handle(5), nullptr, 7, false});
  EXPECT_FALSE(t.check());  // still mapped in the books: the invariant fails
  t.set_unmapped(5);
  EXPECT_TRUE(t.check());
  EXPECT_TRUE(t.has_retired(5, 6));
  EXPECT_FALSE(t.has_retired(0, 5));
  EXPECT_FALSE(t.has_retired(6, 8));
}

TEST(PageTable, RetiredPagesStayInIndexOrderAndLeaveOneByOne) {
  page_table t;
  t.reset(16);
  t.reserve_retired(4);
  for (std::size_t i : {9, 3, 12, 6}) t.retire({i, 100 + i, nullptr, i, false});
  EXPECT_EQ(retired_indices(t), (std::vector<std::size_t>{3, 6, 9, 12}));
  EXPECT_EQ(t.retired_from(7)->index, 9u);
  EXPECT_EQ(t.retired_from(13), t.retired().end());
  EXPECT_TRUE(t.check());
  EXPECT_TRUE(t.release_at_unmap(106));
  EXPECT_FALSE(t.release_at_unmap(999));
  const auto done = t.unretire(1);
  EXPECT_EQ(done.index, 6u);
  EXPECT_TRUE(done.release);
  EXPECT_EQ(retired_indices(t), (std::vector<std::size_t>{3, 9, 12}));
}

}  // namespace
