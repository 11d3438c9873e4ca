// Tags and sleep/wake (SPEC S1-S4) of one device: each named tag's own
// private pool, the paused tags, and the host buffers that keep paused
// contents. Pause and resume orchestrate across the device (events,
// segments, pages, statistics) through device_state's members (a
// pause moves every page of a tag's reservations). Every method needs the
// world lock unless noted; any_paused() is read without one (relaxed).
#pragma once

#include <ccalloc/backend/device_backend.hpp>
#include <ccalloc/core/device_caching_allocator.hpp>
#include <ccalloc/core/tags.hpp>
#include "block.hpp"
#include "host_copy_cache.hpp"
#include "pools.hpp"

#include <atomic>
#include <cstddef>
#include <map>
#include <set>
#include <vector>

namespace ccalloc::detail {

class device_state;
class world_lock;

// The tag of a segment: its private pool's, else default. [none]: fixed for the segment's life
[[nodiscard]] inline tag_id tag_of(const segment& seg) noexcept {
  return seg.head->pool->priv != nullptr ? seg.head->pool->priv->tag : default_tag_id;
}
// The tag of a block's segment, read from the block: its pool is its
// segment's and does not change while the block is allocated or waits for
// events, where the segment's head may (another thread splitting the
// segment's first block under its own stream's lock). [the block's holder]
[[nodiscard]] inline tag_id tag_of(const block& b) noexcept {
  return b.pool->priv != nullptr ? b.pool->priv->tag : default_tag_id;
}

class tag_sleep {
 public:
  // Reads the device number and backend: construct after device_state's backend_.
  explicit tag_sleep(device_state& d);
  tag_sleep(const tag_sleep&) = delete;
  tag_sleep& operator=(const tag_sleep&) = delete;

  // A named tag's own private pool, made on first use; the device's private
  // pools own it. A tag that holds nothing is forgotten: note_if_empty lists
  // its pool when its last segment goes (or a malloc under it made none),
  // and forget_empty_tags, when the world lock that listed it is released,
  // deletes the pool and its streams' pools if it still holds no segment
  // and no allocation is in flight to it. The tag's next use makes a fresh
  // pool; a paused tag stays paused (paused_tags keeps it, not its pool).
  private_pool& tag_pool(tag_id tag);
  // Lists pp for forget_empty_tags when it is a tag's own pool with no
  // segment. Allocates nothing. [world]
  void note_if_empty(private_pool& pp) noexcept;
  // seg leaves its private pool pp (nullptr: it is in a default pool, nothing
  // to do), which is listed when it is a tag's pool left empty. [world]
  void detach_segment(private_pool* pp, segment& seg) noexcept {
    if (pp == nullptr) return;
    pp->detach(seg);
    note_if_empty(*pp);
  }
  // Deletes the listed pools that still hold nothing (their stream_pools in
  // every stream of w first). [world]
  void forget_empty_tags(const world_lock& w) noexcept;
  [[nodiscard]] const std::map<tag_id, private_pool*>& tag_pools() const noexcept { return tag_pools_; }
  [[nodiscard]] bool tag_paused(tag_id tag) const noexcept { return paused_tags_.count(tag) != 0; }
  [[nodiscard]] const std::set<tag_id>& paused_tags() const noexcept { return paused_tags_; }
  // paused_tags() is not empty: the free path looks at a block's segment
  // then. [none] a relaxed load on every free
  [[nodiscard]] bool any_paused() const noexcept { return any_paused_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::vector<segment*> segments_of(tag_id tag) const;
  [[nodiscard]] tag_usage usage_of(tag_id tag) const;

  // pause and resume (sleep_wake.cpp has the steps). Throws
  // invalid_argument_error (the default tag, a capture underway, a segment
  // that is no reservation), out_of_memory_error (no host memory to keep
  // the contents; no device memory to map the pages again: the tag stays
  // paused, resume unlocks w to tell the observers), backend_error. pause
  // first unlocks w while blocks whose events completed are still on their
  // way back to their pools (event_queue::wait_for_completions_in_flight).
  sleep_result pause_tags(const std::vector<tag_id>& tags, bool keep_contents, world_lock& w);
  sleep_result resume_tags(const std::vector<tag_id>& tags, world_lock& w);
  // Gives back the host buffers kept for the next pause (empty_cache).
  void release_host_copies() noexcept { host_copies_.release_all(); }

 private:
  // pause_tags' steps, in order.
  [[nodiscard]] std::vector<tag_id> tags_to_pause(const std::vector<tag_id>& tags, const std::string& where) const;
  [[nodiscard]] std::vector<segment*> pausable_segments(const std::vector<tag_id>& todo,
                                                        const std::string& where) const;
  void wait_for_tag_work(const std::vector<segment*>& segs);
  void return_tag_cache(const std::vector<segment*>& segs, sleep_result& r);
  void take_host_copies(const std::vector<segment*>& segs, const std::string& where);
  void pause_segment(segment& seg, bool keep_contents, sleep_result& r);
  // resume_tags' steps, in order.
  void make_room(std::size_t need, sleep_result& r, world_lock& w);
  // Maps seg's paused runs again; on failure (false, or a throw) every page
  // this call mapped goes back and seg stays paused.
  bool map_paused_segment(segment& seg);
  // Gives back the pages of seg's paused runs mapped so far, after the
  // copies queued into them: seg is paused again, as the books say.
  void unmap_resumed_pages(segment& seg) noexcept;
  // The steps of a resume that may still fail, once every page is mapped:
  // the copies back have been read, the blocks taken out of their pools are
  // back in them. On a throw, nothing of them stays done.
  void finish_mapping(const std::vector<segment*>& segs);
  [[noreturn]] void fail_resume(const std::vector<tag_id>& todo, const std::vector<segment*>& mapped,
                                std::size_t need, const sleep_result& r, world_lock& w);
  // Marks seg resumed (after finish_mapping): allocates nothing.
  void restore_paused_segment(segment& seg, sleep_result& r) noexcept;
  // The host waits for the work queued on `stream` so far (an event
  // recorded there; never the whole device).
  void wait_for_stream(stream_t stream);

  device_state& d_;
  std::map<tag_id, private_pool*> tag_pools_;
  private_pool* to_forget_ = nullptr;  // note_if_empty's list (private_pool::next_to_forget)
  std::set<tag_id> paused_tags_;
  std::atomic<bool> any_paused_{false};
  host_copy_cache host_copies_;  // kept contents' host buffers
};

}  // namespace ccalloc::detail
