// NCCL registrations kept in step with the allocator's mapping announcements
// (SPEC C2; ccalloc/frontend/nccl_registration.hpp).
//
// State, per device: `mapped`, the mapped ranges as announced (pages of
// expandable segments merged where they touch; plain segments kept apart,
// one range each: NCCL registers within one allocation). Per communicator:
// its registrations, disjoint, each inside one mapped range. Invariant:
// every registration lies inside `mapped`; nothing else is registered.
#include <ccalloc/frontend/nccl_registration.hpp>

#include <ccalloc/base/errors.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <dlfcn.h>

#include <iterator>
#include <utility>

namespace ccalloc {

nccl_functions nccl_functions::load(const std::string& library) {
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) throw nccl_error("ccalloc: cannot load NCCL (" + library + "): " + dlerror());
  nccl_functions f;
  f.comm_register = reinterpret_cast<decltype(f.comm_register)>(dlsym(handle, "ncclCommRegister"));
  f.comm_deregister = reinterpret_cast<decltype(f.comm_deregister)>(dlsym(handle, "ncclCommDeregister"));
  if (f.comm_register == nullptr || f.comm_deregister == nullptr)
    throw nccl_error("ccalloc: " + library + " has no ncclCommRegister/ncclCommDeregister (NCCL 2.19 or later needed)");
  return f;
}

struct nccl_registration::state {
  struct mapped_range {
    std::uintptr_t hi = 0;
    bool expandable = false;
  };
  struct registration {
    std::uintptr_t hi = 0;
    void* handle = nullptr;
  };
  struct communicator {
    void* comm = nullptr;
    int device = 0;
    std::map<std::uintptr_t, registration> registered;  // by start
  };

  nccl_functions nccl;
  int device_count = 0;  // the backend's devices: ensure() accepts [0, device_count)
  mutable std::mutex mutex;
  bool alive = true;                                              // [mutex]
  std::map<int, std::map<std::uintptr_t, mapped_range>> mapped;  // [mutex] device -> start -> range
  std::vector<communicator> comms;                                // [mutex]
  nccl_registration_stats counters;                               // [mutex]

  void on_event(const mapping_event& e) {
    std::lock_guard lock(mutex);
    if (!alive) return;
    const std::uintptr_t lo = e.addr;
    const std::uintptr_t hi = e.addr + e.size_bytes;
    if (e.change == mapping_change::map) {
      add_mapped(e.device, lo, hi, e.expandable);
    } else if (e.change == mapping_change::unmap) {
      for (communicator& c : comms)
        if (c.device == e.device) drop_overlapping(c, lo, hi);
      remove_mapped(e.device, lo, hi);
    }
  }

  void add_mapped(int device, std::uintptr_t lo, std::uintptr_t hi, bool expandable) {
    auto& m = mapped[device];
    if (expandable) {  // merge with touching expandable neighbours
      if (auto next = m.find(hi); next != m.end() && next->second.expandable) {
        hi = next->second.hi;
        m.erase(next);
      }
      if (auto it = m.lower_bound(lo); it != m.begin()) {
        auto prev = std::prev(it);
        if (prev->second.expandable && prev->second.hi == lo) {
          lo = prev->first;
          m.erase(prev);
        }
      }
    }
    m[lo] = {hi, expandable};
  }

  void remove_mapped(int device, std::uintptr_t lo, std::uintptr_t hi) {
    auto& m = mapped[device];
    auto it = m.upper_bound(lo);
    if (it != m.begin()) it = std::prev(it);
    while (it != m.end() && it->first < hi) {
      const std::uintptr_t a = it->first;
      const mapped_range r = it->second;
      if (r.hi <= lo) {
        ++it;
        continue;
      }
      it = m.erase(it);
      if (a < lo) m[a] = {lo, r.expandable};
      if (hi < r.hi) m[hi] = {r.hi, r.expandable};
    }
  }

  // Deregisters c's registrations that overlap [lo, hi).
  void drop_overlapping(communicator& c, std::uintptr_t lo, std::uintptr_t hi) noexcept {
    auto it = c.registered.upper_bound(lo);
    if (it != c.registered.begin()) it = std::prev(it);
    while (it != c.registered.end() && it->first < hi) {
      if (it->second.hi <= lo) {
        ++it;
        continue;
      }
      deregister(c, it->first, it->second);
      it = c.registered.erase(it);
    }
  }

  void deregister(communicator& c, std::uintptr_t lo, const registration& r) noexcept {
    ++counters.deregister_calls;
    counters.registered_bytes -= r.hi - lo;
    if (nccl.comm_deregister(c.comm, r.handle) != 0) ++counters.failed_deregistrations;
  }

  // The mapped range of `device` that holds [lo, hi), or nullptr (adds no
  // entry for a device with none).
  const std::pair<const std::uintptr_t, mapped_range>* run_of(int device, std::uintptr_t lo, std::uintptr_t hi) const {
    const auto d = mapped.find(device);
    if (d == mapped.end()) return nullptr;
    auto it = d->second.upper_bound(lo);
    if (it == d->second.begin()) return nullptr;
    --it;
    return it->second.hi >= hi ? &*it : nullptr;
  }

  // Registers the whole mapped run [lo, hi) with c, unless one registration
  // already holds [need_lo, need_hi): the registrations inside the run go
  // first (they become part of the one new registration).
  void cover(communicator& c, std::uintptr_t lo, std::uintptr_t hi, std::uintptr_t need_lo, std::uintptr_t need_hi) {
    if (auto it = c.registered.upper_bound(need_lo); it != c.registered.begin()) {
      --it;
      if (it->first <= need_lo && it->second.hi >= need_hi) return;
    }
    void* handle = nullptr;
    // Registered first, the old ones dropped after: a failure leaves them.
    ++counters.register_calls;
    if (const int rc = nccl.comm_register(c.comm, reinterpret_cast<void*>(lo), hi - lo, &handle); rc != 0)
      throw nccl_error("ccalloc: ncclCommRegister of " + std::to_string(hi - lo) + " bytes failed (ncclResult " +
                       std::to_string(rc) + ")");
    drop_overlapping(c, lo, hi);
    c.registered[lo] = {hi, handle};
    counters.registered_bytes += hi - lo;
  }
};

nccl_registration::nccl_registration(caching_allocator& alloc, nccl_functions nccl)
    : state_(std::make_shared<state>()) {
  if (nccl.comm_register == nullptr || nccl.comm_deregister == nullptr)
    throw invalid_argument_error("ccalloc: nccl_registration: an NCCL function is null");
  state_->nccl = nccl;
  state_->device_count = alloc.backend().device_count();
  // What each device has mapped, listed under the same hold of its locks as
  // the attach (no change falls between the two), then the announcements.
  // Recorded as the announcements would have: a plain segment as one range,
  // an expandable one's mapped runs merged where they touch, a paused
  // segment not at all (mapped_runs).
  std::weak_ptr<state> weak = state_;
  state* s = state_.get();
  alloc.attach_mapping_listener(
      [weak](const mapping_event& e) {
        if (auto live = weak.lock()) live->on_event(e);
      },
      [s](const std::vector<segment_info>& segments) {
        std::lock_guard lock(s->mutex);
        for (const segment_info& seg : segments)
          for (const mapped_run& r : mapped_runs(seg))
            s->add_mapped(seg.device, r.address, r.address + r.size_bytes, seg.is_expandable);
      });
}

nccl_registration::~nccl_registration() {
  std::lock_guard lock(state_->mutex);
  for (auto& c : state_->comms)
    for (const auto& [lo, r] : c.registered) state_->deregister(c, lo, r);
  state_->comms.clear();
  state_->alive = false;
}

void nccl_registration::add_communicator(void* comm, int device) {
  if (device < 0 || device >= state_->device_count)
    throw invalid_argument_error("ccalloc: nccl_registration::add_communicator: device " + std::to_string(device) +
                                 " is out of range (the backend has " + std::to_string(state_->device_count) +
                                 " device(s))");
  std::lock_guard lock(state_->mutex);
  for (const auto& c : state_->comms)
    if (c.comm == comm) throw invalid_argument_error("ccalloc: nccl_registration: the communicator was added before");
  state_->comms.push_back({comm, device, {}});
}

void nccl_registration::remove_communicator(void* comm) {
  std::lock_guard lock(state_->mutex);
  for (auto it = state_->comms.begin(); it != state_->comms.end(); ++it)
    if (it->comm == comm) {
      for (const auto& [lo, r] : it->registered) state_->deregister(*it, lo, r);
      state_->comms.erase(it);
      return;
    }
}

void nccl_registration::ensure(int device, const void* ptr, std::size_t size_bytes) {
  if (device < 0 || device >= state_->device_count)
    throw invalid_argument_error("ccalloc: nccl_registration::ensure: device " + std::to_string(device) +
                                 " is out of range (the backend has " + std::to_string(state_->device_count) +
                                 " device(s))");
  if (size_bytes == 0) return;
  const auto lo = reinterpret_cast<std::uintptr_t>(ptr);
  if (size_bytes > UINTPTR_MAX - lo)
    throw invalid_argument_error("ccalloc: nccl_registration::ensure: size_bytes " + std::to_string(size_bytes) +
                                 " runs past the end of the address space from ptr");
  const std::uintptr_t hi = lo + size_bytes;
  std::lock_guard lock(state_->mutex);
  ++state_->counters.ensure_calls;
  const auto* run = state_->run_of(device, lo, hi);
  if (run == nullptr)
    throw invalid_argument_error("ccalloc: nccl_registration::ensure: " + std::to_string(size_bytes) +
                                 " bytes on device " + std::to_string(device) + " are not mapped by the allocator");
  for (auto& c : state_->comms)
    if (c.device == device) state_->cover(c, run->first, run->second.hi, lo, hi);
}

void nccl_registration::flush() {
  std::lock_guard lock(state_->mutex);
  for (auto& c : state_->comms)
    for (const auto& [lo, r] : state_->mapped[c.device]) state_->cover(c, lo, r.hi, lo, r.hi);
}

nccl_registration_stats nccl_registration::stats() const {
  std::lock_guard lock(state_->mutex);
  return state_->counters;
}

}  // namespace ccalloc
