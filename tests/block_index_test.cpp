// The free-block index of a pool (src/core/detail/device_state.hpp): the
// binned layout must keep exactly the (size, address) order of one sorted
// array, which best fit and therefore every replay figure depend on.
#include "../src/core/detail/device_state.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <iterator>
#include <memory>
#include <random>
#include <set>
#include <utility>
#include <vector>

namespace {

using ccalloc::detail::block;
using ccalloc::detail::block_index;
using key = std::pair<std::size_t, std::uintptr_t>;

TEST(BlockIndex, BinsAreInSizeOrderAndCoverEverySize) {
  std::uint32_t previous = 0;
  for (std::size_t units = 1; units < (std::size_t{1} << 20); units += 1 + units / 64) {
    const std::uint32_t bin = block_index::bin_of(units * 512);
    EXPECT_GE(bin, previous) << units;
    previous = bin;
  }
  EXPECT_EQ(block_index::bin_of(512), 1u);
  EXPECT_EQ(block_index::bin_of(8 * 512), 8u);
  EXPECT_EQ(block_index::bin_of(16 * 512), 12u);   // 4 bins per power of two from 8 units
  EXPECT_EQ(block_index::bin_of(24 * 512), 14u);
  EXPECT_LT(block_index::bin_of(~std::size_t{0} & ~std::size_t{511}), block_index::bin_count);
}

// Random inserts and erases against std::set: every query agrees.
TEST(BlockIndex, AgreesWithASortedSetUnderRandomInsertAndErase) {
  std::mt19937_64 rng(12345);
  std::vector<std::unique_ptr<block>> blocks;
  block_index index;
  std::set<key> reference;
  std::vector<block*> live;
  auto random_size = [&] {
    // Log-uniform 512 B .. 64 GiB, 512-byte multiples; many equal sizes.
    const unsigned octave = 9 + static_cast<unsigned>(rng() % 27);
    const std::size_t size = (std::size_t{1} << octave) + rng() % (std::size_t{1} << octave);
    return rng() % 4 == 0 ? std::size_t{1} << octave : size / 512 * 512;
  };
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      auto b = std::make_unique<block>();
      b->size = random_size();
      b->ptr = (rng() % (std::uintptr_t{1} << 40)) * 512;
      if (reference.count({b->size, b->ptr})) continue;
      index.insert(b.get());
      reference.insert({b->size, b->ptr});
      live.push_back(b.get());
      blocks.push_back(std::move(b));
    } else {
      const std::size_t i = rng() % live.size();
      block* b = live[i];
      ASSERT_TRUE(index.contains(b));
      index.erase(b);
      EXPECT_FALSE(index.contains(b));
      reference.erase({b->size, b->ptr});
      live[i] = live.back();
      live.pop_back();
    }
    ASSERT_EQ(index.size(), reference.size());
    // Best fit for a random request: the first key >= (size, 0).
    const std::size_t want = random_size();
    const auto expected = reference.lower_bound({want, 0});
    const block_index::position found = index.lower_bound(want);
    if (expected == reference.end()) {
      EXPECT_EQ(found, block_index::end());
    } else {
      ASSERT_NE(found, block_index::end());
      EXPECT_EQ(index.at(found)->size, expected->first);
      EXPECT_EQ(index.at(found)->ptr, expected->second);
      // next() walks on in the same order.
      const block_index::position after = index.next(found);
      const auto expected_after = std::next(expected);
      if (expected_after == reference.end()) EXPECT_EQ(after, block_index::end());
      else EXPECT_EQ(index.at(after)->ptr, expected_after->second);
    }
    if (reference.empty()) EXPECT_EQ(index.largest(), nullptr);
    else EXPECT_EQ(index.largest()->size, reference.rbegin()->first);
  }
  // Whole walks, both ways.
  std::vector<key> up, down;
  index.for_each([&](block* b) { up.emplace_back(b->size, b->ptr); });
  index.for_each_descending([&](block* b) {
    down.emplace_back(b->size, b->ptr);
    return true;
  });
  EXPECT_EQ(up, std::vector<key>(reference.begin(), reference.end()));
  EXPECT_EQ(down, std::vector<key>(reference.rbegin(), reference.rend()));
  // A descending walk stops when asked.
  int seen = 0;
  index.for_each_descending([&](block*) { return ++seen < 3; });
  EXPECT_EQ(seen, 3);
}

// Erasing at a position keeps the earlier positions valid: a downward loop
// may erase as it goes.
TEST(BlockIndex, ErasingKeepsEarlierPositions) {
  std::vector<std::unique_ptr<block>> blocks;
  block_index index;
  for (std::size_t i = 1; i <= 40; ++i) {
    auto b = std::make_unique<block>();
    b->size = 512 * (i % 5 + 1);
    b->ptr = i * 4096;
    index.insert(b.get());
    blocks.push_back(std::move(b));
  }
  const block_index::position first = index.lower_bound(0);
  block* first_block = index.at(first);
  index.erase_at(index.next(first));
  EXPECT_EQ(index.at(first), first_block);
  EXPECT_EQ(index.size(), 39u);
}

}  // namespace
