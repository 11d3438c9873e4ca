// The free-block index of a pool (src/core/detail/device_state.hpp): the
// binned layout must keep exactly the (size, address) order of one sorted
// array, which best fit and therefore every replay figure depend on.
#include "../src/core/detail/device_state.hpp"

#include <gtest/gtest.h>

#include <bit>
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
  EXPECT_EQ(block_index::bin_of(0), 0u);  // lower_bound(0): the first bin
  EXPECT_EQ(block_index::bin_of(512), 0u);
  EXPECT_EQ(block_index::bin_of(8 * 512), 7u);
  EXPECT_EQ(block_index::bin_of(9 * 512), 8u);
  EXPECT_EQ(block_index::bin_of(16 * 512), 11u);  // 4 bins per power of two from 9 units
  EXPECT_EQ(block_index::bin_of(17 * 512), 12u);
  EXPECT_EQ(block_index::bin_of(24 * 512), 13u);
  EXPECT_EQ(block_index::bin_of(~std::size_t{0} & ~std::size_t{511}), block_index::bin_count - 1);
}

// bin_of is computed without a branch; it must equal its definition (units
// 1-8 a bin each, then four bins per power of two of units - 1) for every
// size, including sizes that are not multiples of 512 (lower_bound's
// argument need not be rounded).
TEST(BlockIndex, BinOfEqualsItsDefinition) {
  const auto defined = [](std::size_t size_bytes) -> std::uint32_t {
    const std::size_t units = size_bytes >> 9;
    const std::size_t u = units == 0 ? 0 : units - 1;
    if (u < 8) return static_cast<std::uint32_t>(u);
    const auto e = static_cast<std::uint32_t>(std::bit_width(u) - 1);
    return (e - 1) * 4 + static_cast<std::uint32_t>((u >> (e - 2)) & 3);
  };
  for (std::size_t size = 0; size < (std::size_t{1} << 22); size += 97)
    ASSERT_EQ(block_index::bin_of(size), defined(size)) << size;
  std::mt19937_64 rng(7);
  for (int i = 0; i < 100000; ++i) {
    const std::size_t size = rng() >> (rng() % 64);
    ASSERT_EQ(block_index::bin_of(size), defined(size)) << size;
  }
  for (unsigned k = 9; k < 64; ++k) {
    const std::size_t p = std::size_t{1} << k;
    for (const std::size_t size : {p - 1, p, p + 1, p + 511, p + 512})
      ASSERT_EQ(block_index::bin_of(size), defined(size)) << size;
  }
}

// Bins are ranges (lo, hi] of sizes: the usual segment sizes are a bin's top,
// so a whole segment and the same segment less a small allocation share a bin.
TEST(BlockIndex, AWholeSegmentSharesItsBinWithItsSmallSplits) {
  constexpr std::size_t mib = std::size_t{1} << 20;
  EXPECT_EQ(block_index::bin_of(2 * mib), block_index::bin_of(2 * mib - 512));
  EXPECT_EQ(block_index::bin_of(2 * mib), block_index::bin_of(2 * mib - 256 * 1024 + 512));
  EXPECT_NE(block_index::bin_of(2 * mib), block_index::bin_of(2 * mib + 512));
  EXPECT_EQ(block_index::bin_of(20 * mib), block_index::bin_of(20 * mib - 4 * mib + 512));
  EXPECT_NE(block_index::bin_of(20 * mib), block_index::bin_of(20 * mib + 512));
}

// rekey_at (a split's remainder, a merge) against std::set: the same index as
// erase_at + insert, whether the entry stays in place or moves.
TEST(BlockIndex, RekeyAtAgreesWithEraseAndInsert) {
  std::mt19937_64 rng(777);
  std::vector<std::unique_ptr<block>> blocks;
  block_index index;
  std::set<key> reference;
  std::vector<block*> live;
  std::uintptr_t next_ptr = std::uintptr_t{1} << 30;
  for (int i = 0; i < 300; ++i) {
    auto b = std::make_unique<block>();
    b->size = 512 * (1 + rng() % 8192);
    b->ptr = next_ptr;
    next_ptr += std::uintptr_t{1} << 30;  // room to grow or shrink without overlap
    index.insert(b.get());
    reference.insert({b->size, b->ptr});
    live.push_back(b.get());
    blocks.push_back(std::move(b));
  }
  int moved = 0, in_place = 0;
  for (int step = 0; step < 20000; ++step) {
    block* b = live[rng() % live.size()];
    const block_index::position at = index.find(b);
    ASSERT_NE(at, block_index::end());
    reference.erase({b->size, b->ptr});
    // Shrink from the front or the back (a split) or grow (a merge), by a small or a large step.
    const std::size_t step_bytes = 512 * (rng() % 2 == 0 ? 1 + rng() % 4 : 1 + rng() % 4096);
    switch (rng() % 3) {
      case 0:
        if (b->size > step_bytes) {
          b->size -= step_bytes;
          b->ptr += step_bytes;
        }
        break;
      case 1:
        if (b->size > step_bytes) b->size -= step_bytes;
        break;
      default:
        b->size += step_bytes;
        if (rng() % 2 == 0) b->ptr -= step_bytes;
    }
    reference.insert({b->size, b->ptr});
    index.rekey_at(at, b);
    const block_index::position now = index.find(b);
    ASSERT_NE(now, block_index::end());
    (now == at ? in_place : moved) += 1;
    ASSERT_EQ(index.size(), reference.size());
  }
  std::vector<key> up;
  index.for_each([&](block* x) { up.emplace_back(x->size, x->ptr); });
  EXPECT_EQ(up, std::vector<key>(reference.begin(), reference.end()));
  // Both ways were taken (the test covers the in-place rewrite and the move).
  EXPECT_GT(in_place, 1000);
  EXPECT_GT(moved, 1000);
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

// find() reads where the index put each block (block::index_bin, index_pos)
// instead of searching: after random inserts, erases and rekeys, including
// a rekey that hands an entry to another block (a free merged with its free
// neighbour takes the neighbour's entry), every block in the index is found
// at its own entry, and a block that left it is not found.
TEST(BlockIndex, FindIsWhereTheIndexKeepsEachBlock) {
  std::mt19937_64 rng(4242);
  std::vector<std::unique_ptr<block>> blocks;
  block_index index;
  std::set<key> reference;
  std::vector<block*> live, gone;
  std::uintptr_t next_ptr = std::uintptr_t{1} << 30;
  auto fresh = [&](std::size_t size) {
    auto b = std::make_unique<block>();
    b->size = size;
    b->ptr = next_ptr;
    next_ptr += std::uintptr_t{1} << 30;
    blocks.push_back(std::move(b));
    return blocks.back().get();
  };
  int handed_over = 0;
  for (int step = 0; step < 20000; ++step) {
    const unsigned op = static_cast<unsigned>(rng() % 4);
    if (live.size() < 8 || op == 0) {
      block* b = fresh(512 * (1 + rng() % 64));  // few bins: shifts on most inserts
      index.insert(b);
      reference.insert({b->size, b->ptr});
      live.push_back(b);
    } else if (op == 1) {
      const std::size_t i = rng() % live.size();
      block* b = live[i];
      const block_index::position at = index.find(b);
      ASSERT_NE(at, block_index::end());
      index.erase_at(at);
      reference.erase({b->size, b->ptr});
      gone.push_back(b);
      live[i] = live.back();
      live.pop_back();
    } else {
      // Rekey: the same block (a split's remainder) or another one that
      // takes over the entry with a grown key (a merge).
      const std::size_t i = rng() % live.size();
      block* b = live[i];
      const block_index::position at = index.find(b);
      ASSERT_NE(at, block_index::end());
      reference.erase({b->size, b->ptr});
      block* to = b;
      if (op == 3) {
        to = fresh(b->size + 512 * (1 + rng() % 4));
        live[i] = to;
        gone.push_back(b);
        ++handed_over;
      } else {
        b->size = 512 * (1 + rng() % 64);
      }
      index.rekey_at(at, to);
      reference.insert({to->size, to->ptr});
    }
    ASSERT_EQ(index.size(), reference.size());
    if (step % 16 == 0) {
      for (block* b : live) {
        const block_index::position at = index.find(b);
        ASSERT_NE(at, block_index::end()) << "step " << step;
        ASSERT_EQ(index.at(at), b) << "step " << step;
      }
      for (block* b : gone) ASSERT_FALSE(index.contains(b)) << "step " << step;
    }
  }
  std::vector<key> up;
  index.for_each([&](block* x) { up.emplace_back(x->size, x->ptr); });
  EXPECT_EQ(up, std::vector<key>(reference.begin(), reference.end()));
  EXPECT_GT(handed_over, 1000);
}
