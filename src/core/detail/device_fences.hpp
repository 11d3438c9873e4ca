// The page fences of one device: each stream's page_fences (page_fences.hpp,
// in stream_state::fences) driven with this device's event pool and backend.
// Owns the page_fences::device adapter over them and whether the backend can
// make a stream wait on an event (stream_wait). A stream's fences change
// under the world lock, or under its stream lock and the device lock
// (before_free); the methods say which they need.
#pragma once

#include <ccalloc/backend/device_backend.hpp>
#include "page_fences.hpp"
#include "pools.hpp"

#include <cstdint>
#include <optional>

namespace ccalloc::detail {

class device_state;
class world_lock;
struct block;
struct stream_state;

class device_fences {
 public:
  // Reads the backend's capabilities: construct after device_state's backend_.
  explicit device_fences(device_state& d) noexcept;
  device_fences(const device_fences&) = delete;
  device_fences& operator=(const device_fences&) = delete;

  // Whether free block b's memory (the stream's free numbered free_seq) has
  // no work of its stream left, never blocking (records a fence where none
  // covers it and can_record_on allows); wait_fences blocks until every free
  // of the stream has none, counted in num_device_synchronizations and under
  // `why`; await_fence is the two together (wait unless completed). [world]
  bool fence_completed(block* b);
  bool fence_completed(stream_state& ss, std::uint64_t free_seq);
  void wait_fences(stream_state& ss, page_fences::wait_reason why);
  void await_fence(block* b, page_fences::wait_reason why);
  // Polls every stream's fences and records one where a stream freed blocks
  // since its newest fence and may be recorded on. [world]
  void fence_streams(const world_lock& w);
  // Records a fence on ss covering the free about to happen. [stream] takes the device lock
  void fence_before_free(stream_state& ss);
  // Cross-stream reuse with a device-side wait (reuse_with_stream_wait):
  // whether `to` may wait on the device for another stream's fence now (no
  // capture, `to` live and nameable, the backend can wait); and the fence
  // of `owner` covering its free numbered free_seq (event, the free count
  // it covers), recorded now where can_record_on allows; nullopt when there
  // is none. [world]
  [[nodiscard]] bool may_wait_on_device(const stream_state& to);
  [[nodiscard]] std::optional<page_fences::fence> fence_covering(stream_state& owner, std::uint64_t free_seq);
  // Whether the allocator may record an event on the stream now: the legacy
  // default stream, or the stream of the malloc whose slow path this thread
  // runs (the caller's stream exists). A stream that only freed blocks may
  // have been destroyed since (legal in CUDA: the frees are stream-ordered),
  // and recording on a destroyed stream is undefined behaviour (a crash on
  // an H200), so other streams' fences are only polled; waiting on such a
  // stream synchronizes the device instead. [world]; per thread, race-free
  // (a thread_local: fallback_ladder.cpp).
  [[nodiscard]] bool can_record_on(const stream_state& ss) const noexcept;
  // The adapter page_fences records, polls and waits through.
  [[nodiscard]] page_fences::device& events() noexcept { return events_; }

 private:
  // page_fences::device over this device's event pool and backend.
  struct event_source final : page_fences::device {
    explicit event_source(device_state& s) noexcept : d(s) {}
    device_state& d;
    event_t take_event() override;
    void give_event(event_t e) override;
    bool query(event_t e) override;
    void record(event_t e, stream_t stream) override;
    void synchronize(event_t e) override;
    void synchronize_device() override;
  };
  device_state& d_;
  event_source events_;
  bool stream_wait_supported_;  // the backend's capabilities().stream_wait
};

}  // namespace ccalloc::detail
