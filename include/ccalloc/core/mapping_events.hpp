// ccalloc/core/mapping_events.hpp: announcements of every change of what a
// device's allocator has mapped (SPEC C1), for whatever outside the
// allocator holds on to device addresses: NCCL user-buffer registration,
// NVLS, RDMA memory regions, IPC exports.
//
// What it is: a mapping listener, attached to an allocator, is called at
// each change, synchronously, on the thread that makes it:
//   - map: after the range is mapped (a plain segment came from the device,
//     or pages of an expandable segment were mapped);
//   - unmap: before the range stops being usable at its address (a plain
//     segment goes back, pages are unmapped or retired for a deferred
//     unmap); the range is still mapped while the listener runs;
//   - move: the range stays mapped where it is and now belongs to `stream`
//     (an idle reservation handed to another stream);
//   - unmap_completed: a deferred unmap (an `unmap` with reason
//     pages_retired, announced earlier) was carried out by the device; what
//     is mapped did not change.
// A registration table that inserts at map and erases at unmap equals the
// allocator's mapped ranges after every call, and never holds a range the
// device has unmapped (tests/property_test.cpp checks both).
//
// Order: announcements of one device are made under its locks, in the
// order of the changes; a range is announced unmapped before it can be
// announced mapped again. Ranges are page-aligned for expandable segments
// (the backend's page bytes) and whole segments for plain ones; an unmap
// never splits a range announced by one map of a plain segment.
//
// What a listener may do: read the event, call other libraries (e.g.
// ncclCommRegister / ncclCommDeregister), take its own locks, and, of
// caching_allocator, attach_mapping_listener (the new listener hears the
// next announcement), config(), is_history_enabled(), get_user_metadata().
// It must not call into any ccalloc allocator otherwise (the device's locks
// are held: that would deadlock), and should return quickly (it delays
// every thread of the device). Such a call does not hang: init(), enable(),
// set_config(), record_history(), set_user_metadata(), whatever takes a
// device's world lock first (empty_cache, pause, resume, snapshot,
// segments) and every call that names a device (statistics, memory
// fraction, pools, tag usage) throw ccalloc::invalid_argument_error naming
// the rule (the C API: CCALLOC_ERROR_INVALID_ARGUMENT), changing nothing; a call that would
// first wait on another lock the announcing thread holds (malloc and free,
// which take their stream's lock before anything else) stops the process
// with that message on stderr
// (the check sits on the locks' contended path: no cost when uncontended).
// An exception a listener throws is dropped; the allocator's state is
// unaffected and the other listeners still run.
//
// Cost: none on malloc/free served from the cache. Where the mapping
// changes, one relaxed atomic load when no listener is attached.
#pragma once

#include <ccalloc/base/types.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string_view>

namespace ccalloc {

/// What changed (see the file comment for when each is announced).
enum class mapping_change : std::uint8_t {
  map,              ///< the range is now mapped (announced after)
  unmap,            ///< the range is about to stop being mapped (announced before)
  move,             ///< the range stays mapped and now belongs to `stream`
  unmap_completed,  ///< a deferred unmap was done by the device; no change of the table
};

/// Why the mapping changed.
enum class mapping_reason : std::uint8_t {
  segment_alloc,      ///< map: a plain segment came from the device (PyTorch: SEGMENT_ALLOC)
  segment_free,       ///< unmap: a plain segment goes back to the device (SEGMENT_FREE)
  pages_mapped,       ///< map: pages of an expandable segment mapped for a request (SEGMENT_MAP)
  pages_recycled,     ///< unmap: free pages unmapped to be mapped where a request needs them (SEGMENT_UNMAP)
  pages_released,     ///< unmap: free pages given back to the device (empty_cache, out of memory, a failed request)
  pages_retired,      ///< unmap: free pages moved to another place, their own unmap deferred until
                      ///< the freeing stream's work has run; then unmap_completed
  reservation_moved,  ///< move: an idle reservation of another stream passed whole to `stream`
  deferred_unmap,     ///< unmap_completed: the device unmapped retired pages
  pages_paused,       ///< unmap: pages of a paused tag released, their addresses kept reserved (pause)
  pages_resumed,      ///< map: pages of a paused tag mapped again at the same addresses (resume)
};

/// The name of a change / reason ("unmap", "pages_retired"). Never fails.
[[nodiscard]] std::string_view to_string(mapping_change change) noexcept;
[[nodiscard]] std::string_view to_string(mapping_reason reason) noexcept;

/// One announcement. [addr, addr + size_bytes) on `device`.
struct mapping_event {
  mapping_change change = mapping_change::map;
  mapping_reason reason = mapping_reason::segment_alloc;
  int device = 0;
  std::uintptr_t addr = 0;
  std::size_t size_bytes = 0;
  /// The stream that owns the range (for move: the new owner).
  stream_t stream = 0;
  /// Part of an expandable segment (pages), rather than a whole plain segment.
  bool expandable = false;
};

/// See the file comment: called under the device's locks, must not call
/// into the allocator; exceptions are dropped.
using mapping_listener = std::function<void(const mapping_event&)>;

}  // namespace ccalloc
