// The begin_allocate_to_pool scopes of one device (src/core/detail/pool_scopes.hpp):
// routing to the newest scope whose filter accepts a stream, closing by pool
// id, and the streams seen capturing while a scope is open.
#include "../src/core/detail/pool_scopes.hpp"

#include <gtest/gtest.h>

#include <vector>

namespace {

using ccalloc::stream_t;
using ccalloc::detail::pool_scopes;
using ccalloc::detail::private_pool;

// Two private pools (ids {1, 1} and {1, 2}) and no scope open.
struct pools_and_scopes {
  pools_and_scopes() {
    a.id = {1, 1};
    b.id = {1, 2};
  }
  private_pool a;
  private_pool b;
  pool_scopes s;
};

TEST(PoolScopes, RouteToTheNewestScopeWhoseFilterAccepts) {
  pools_and_scopes f;
  auto& [a, b, s] = f;
  EXPECT_FALSE(s.active());
  EXPECT_EQ(s.routed(stream_t{7}), nullptr);
  s.open(&a, [](stream_t) { return true; });
  s.open(&b, [](stream_t st) { return st == stream_t{7}; });
  EXPECT_EQ(s.depth(), 2u);
  EXPECT_EQ(s.routed(stream_t{7}), &b);  // newest first
  EXPECT_EQ(s.routed(stream_t{8}), &a);  // b's filter refuses it
  EXPECT_TRUE(s.routes_to(&a));
  // Closing a pool with no open scope changes nothing.
  EXPECT_FALSE(s.close({9, 9}));
  EXPECT_EQ(s.depth(), 2u);
  EXPECT_TRUE(s.close(b.id));
  EXPECT_FALSE(s.routes_to(&b));
  EXPECT_EQ(s.routed(stream_t{7}), &a);
  EXPECT_TRUE(s.close(a.id));
  EXPECT_FALSE(s.active());
  EXPECT_EQ(s.routed(stream_t{8}), nullptr);
}

TEST(PoolScopes, CloseTakesTheNewestScopeOfThePool) {
  pools_and_scopes f;
  auto& [a, b, s] = f;
  s.open(&a, [](stream_t st) { return st == stream_t{1}; });
  s.open(&b, [](stream_t) { return true; });
  s.open(&a, [](stream_t st) { return st == stream_t{2}; });
  ASSERT_TRUE(s.close(a.id));  // the newest of a's two: stream 2 now goes to b
  EXPECT_EQ(s.routed(stream_t{2}), &b);
  ASSERT_TRUE(s.close(b.id));
  EXPECT_EQ(s.routed(stream_t{1}), &a);  // a's older scope is still open
  EXPECT_EQ(s.routed(stream_t{2}), nullptr);
}

TEST(PoolScopes, CapturingStreamsArePrunedAndForgottenWhenTheLastScopeCloses) {
  private_pool a;
  a.id = {1, 1};
  pool_scopes s;
  s.open(&a, [](stream_t) { return true; });
  s.note_capturing(stream_t{3});
  s.note_capturing(stream_t{4});
  s.note_capturing(stream_t{3});  // once
  std::vector<stream_t> asked;
  // Stream 3 has stopped, stream 4 still captures.
  EXPECT_TRUE(s.any_capturing([&](stream_t st) {
    asked.push_back(st);
    return st == stream_t{4};
  }));
  EXPECT_EQ(asked, (std::vector<stream_t>{stream_t{3}, stream_t{4}}));
  asked.clear();
  EXPECT_TRUE(s.any_capturing([&](stream_t st) {
    asked.push_back(st);
    return true;
  }));
  EXPECT_EQ(asked, std::vector<stream_t>{stream_t{4}});  // 3 was forgotten
  ASSERT_TRUE(s.close(a.id));
  EXPECT_FALSE(s.any_capturing([](stream_t) { return true; }));  // nothing remembered
}

}  // namespace
