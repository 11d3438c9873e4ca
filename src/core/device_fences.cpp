// The page fences of one device (device_fences.hpp): polled, recorded and
// waited for over this device's event pool and backend.
#include "detail/device_state.hpp"

#include <ccalloc/base/detail/assert.hpp>

#include <cstdint>
#include <optional>

namespace ccalloc::detail {

device_fences::device_fences(device_state& d) noexcept
    : d_(d), events_(d), stream_wait_supported_(d.backend().capabilities().stream_wait) {}

event_t device_fences::event_source::take_event() { return d.events().get_event(); }
void device_fences::event_source::give_event(event_t e) { d.events().give_event(e); }
bool device_fences::event_source::query(event_t e) { return d.backend().query_event(d.device(), e); }
void device_fences::event_source::record(event_t e, stream_t stream) {
  d.backend().record_event(d.device(), e, stream);
}
void device_fences::event_source::synchronize(event_t e) { d.backend().synchronize_event(d.device(), e); }
void device_fences::event_source::synchronize_device() { d.backend().synchronize_device(d.device()); }

// Free block b was last used on its stream (uses on other streams completed
// before it became free): its pages may change hands once an event recorded
// on that stream after it became free has completed. Never blocks.
bool device_fences::fence_completed(block* b) { return fence_completed(*b->pool->owner, b->free_seq); }

// Whether the stream's work before its free numbered `free_seq` has run
// (the same rules; a deferred unmap asks with the freed block's count).
bool device_fences::fence_completed(stream_state& ss, std::uint64_t free_seq) {
  if (ss.gone) ss.fences.all_completed(ss.free_seq);  // no work left on a destroyed stream
  if (free_seq <= ss.fences.completed_up_to()) return true;
  const bool done = ss.fences.completed(events_, ss.stream, free_seq, ss.free_seq, can_record_on(ss));
  CCALLOC_ASSERT_EXPENSIVE(ss.fences.check());
  return done;
}

void device_fences::await_fence(block* b, page_fences::wait_reason why) {
  if (!fence_completed(b)) wait_fences(*b->pool->owner, why);
}

// Whether stream `to` may be made to wait on the device for another
// stream's fence (reuse_with_stream_wait): the backend can (capabilities),
// no graph capture is underway (known to the allocator, or of `to`: the
// wait would become a graph dependency), `to` is not known destroyed and
// can be named on this thread (not another thread's per-thread default
// stream). The owner of the fence is never asked (it may have been
// destroyed without the allocator being told; the caller skips those it
// knows gone): its fence is an event recorded outside any capture the
// allocator knows of, and waiting on an event needs no live stream.
bool device_fences::may_wait_on_device(const stream_state& to) {
  if (!stream_wait_supported_ || to.gone) return false;
  if (device_backend::is_per_thread_stream(to.stream) && !device_backend::is_calling_thread_stream(to.stream))
    return false;
  if (d_.pools().capture_underway()) return false;
  try {
    return !d_.backend().is_capturing(d_.device(), to.stream);
  } catch (...) {
    return false;  // CUDA may refuse to say while another stream captures: stay on the safe side
  }
}

// The oldest outstanding fence of `owner` that covers its free numbered
// `free_seq` (its count at recording is at least free_seq), with that
// count, recording one on the stream first where none does and
// can_record_on allows; nullopt otherwise (another stream's slow path never
// records on a stream that may be gone or busy elsewhere: no wait, the
// pages stay).
std::optional<page_fences::fence> device_fences::fence_covering(stream_state& owner, std::uint64_t free_seq) {
  if (owner.fences.recorded_up_to() >= free_seq)  // can_record_on only where a record is wanted
    return owner.fences.covering(events_, owner.stream, free_seq, owner.free_seq, false);
  return owner.fences.covering(events_, owner.stream, free_seq, owner.free_seq, can_record_on(owner));
}

// Polls every stream's fences, and records a fence on the streams it may
// record on (can_record_on: the malloc's own stream, the legacy default
// stream) with blocks freed since their newest fence, so that the pages freed now are known
// safe at a later recycling even where the device runs behind the host: a
// fence recorded only when the pages are wanted would cover all the work
// queued up to then. Cheap: at most two event records, on the slow path only.
void device_fences::fence_streams(const world_lock& w) {
  for (stream_state* ss : w.streams()) {
    ss->fences.poll(events_);
    if (ss->free_seq > ss->fences.recorded_up_to() && can_record_on(*ss))
      ss->fences.record(events_, ss->stream, ss->free_seq);
  }
}

// Blocks until every block freed on the stream so far has no work of the
// stream left (counted): waits for a fence covering them, recorded now if
// the stream may be recorded on; else (the stream may be gone) synchronizes
// the device, which covers every stream's work.
void device_fences::wait_fences(stream_state& ss, page_fences::wait_reason why) {
  if (ss.gone) ss.fences.all_completed(ss.free_seq);  // no work left on a destroyed stream
  if (ss.fences.wait(events_, ss.stream, ss.free_seq, can_record_on(ss), why))
    ++d_.stats().values().num_device_synchronizations;
  CCALLOC_ASSERT_EXPENSIVE(ss.fences.check());
}

}  // namespace ccalloc::detail
