// Trace replay on the simulated device (SPEC X8). See
// include/ccalloc/replay/replay.hpp for the model.
#include <ccalloc/replay/replay.hpp>

#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <chrono>
#include <memory>
#include <unordered_map>
#include <vector>

namespace ccalloc {

namespace {

constexpr std::uint64_t never = ~std::uint64_t{0};

// For each free_requested event, the index of its free_completed event
// (`never` if the trace ends first). Also validates the pairing.
std::vector<std::uint64_t> completion_indices(const trace& t) {
  std::vector<std::uint64_t> completion(t.events.size(), never);
  std::unordered_map<std::uint64_t, std::uint64_t> requested_at;  // addr -> free_requested index
  requested_at.reserve(1024);
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const trace_event& e = t.events[i];
    if (e.action == trace_action::free_requested) {
      requested_at[e.addr] = i;
    } else if (e.action == trace_action::free_completed) {
      auto it = requested_at.find(e.addr);
      if (it == requested_at.end())
        throw trace_error(t.source, e.line,
                          "free_completed of address " + std::to_string(e.addr) + " with no free_requested before it");
      completion[it->second] = i;
      requested_at.erase(it);
    }
  }
  return completion;
}

}  // namespace

replay_result replay_trace(const trace& t, const replay_options& options) {
  allocator_config config = allocator_config::parse(options.config);
  sim_options so;
  so.capacity_bytes = options.device_memory_bytes;
  auto sim = std::make_shared<sim_backend>(so);
  caching_allocator allocator(sim, config);
  allocator.init(1);

  const std::vector<std::uint64_t> completion = completion_indices(t);

  struct live_alloc {
    void* ptr = nullptr;  // nullptr: the allocation failed (OOM) in this replay
    std::uint64_t line = 0;
  };
  std::unordered_map<std::uint64_t, live_alloc> live;  // trace address -> our allocation
  live.reserve(4096);
  // Side streams standing in for the program's other streams during a block's
  // free_requested .. free_completed gap; reused once their work is done.
  std::vector<stream_t> side_streams;

  replay_result r;
  r.source = t.source;
  r.config = options.config;
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const trace_event& e = t.events[i];
    sim->advance_to(i);
    switch (e.action) {
      case trace_action::alloc: {
        auto [it, fresh] = live.try_emplace(e.addr);
        if (!fresh)
          throw trace_error(t.source, e.line,
                            "alloc at address " + std::to_string(e.addr) + ", which is still live (allocated at line " +
                                std::to_string(it->second.line) + ")");
        it->second.line = e.line;
        try {
          it->second.ptr = allocator.malloc(0, e.size, static_cast<stream_t>(e.stream));
        } catch (const out_of_memory_error&) {
          ++r.ooms;
          it->second.ptr = nullptr;
        }
        break;
      }
      case trace_action::free_requested: {
        auto it = live.find(e.addr);
        if (it == live.end())
          throw trace_error(t.source, e.line,
                            "free_requested of address " + std::to_string(e.addr) + " with no live allocation");
        void* ptr = it->second.ptr;
        live.erase(it);
        if (ptr == nullptr) break;  // its alloc failed
        if (completion[i] > i + 1) {
          // The block stays in use on another stream until its free_completed.
          stream_t side = 0;
          bool found = false;
          for (stream_t s : side_streams)
            if (sim->busy_until(0, s) <= i) {
              side = s;
              found = true;
              break;
            }
          if (!found) {
            side = sim->create_stream(0);
            side_streams.push_back(side);
          }
          // A block never completed in the trace stays busy until its end.
          sim->enqueue_work(0, side, completion[i] == never ? t.events.size() : completion[i]);
          allocator.record_stream(ptr, side);
        }
        allocator.free(ptr);
        break;
      }
      default:
        break;  // free_completed is the side stream's work ending; segment events are the recorder's
    }
  }
  r.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.events = t.events.size();
  const device_stats s = allocator.get_device_stats(0);
  r.peak_requested_bytes = static_cast<std::uint64_t>(s.requested_bytes[0].peak);
  r.peak_allocated_bytes = static_cast<std::uint64_t>(s.allocated_bytes[0].peak);
  r.peak_reserved_bytes = static_cast<std::uint64_t>(s.reserved_bytes[0].peak);
  r.device_mallocs = static_cast<std::uint64_t>(s.num_device_alloc);
  r.device_frees = static_cast<std::uint64_t>(s.num_device_free);
  r.alloc_retries = static_cast<std::uint64_t>(s.num_alloc_retries);
  return r;
}

}  // namespace ccalloc
