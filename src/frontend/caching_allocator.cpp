// The multi-device front end: device allocators, the sharded pointer map,
// the thread's current stream.
#include <ccalloc/frontend/caching_allocator.hpp>
#include <ccalloc/base/detail/hot_tls.hpp>
#include <ccalloc/base/detail/pointer_text.hpp>
#include <ccalloc/base/detail/locked_callback.hpp>
#include <ccalloc/base/detail/spin_mutex.hpp>
#include <ccalloc/base/printable_text.hpp>

#include "ipc_cache.hpp"
#include "ipc_export.hpp"

#include <ccalloc/backend/default_backend.hpp>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iterator>
#include <mutex>
#include <string>

namespace ccalloc {

namespace {

CCALLOC_HOT_TLS thread_local stream_t tls_current_stream = default_stream;

// The allocator whose config_mutex_ this thread holds while enable() or
// set_config() change the devices, which may announce mapping changes: a
// listener they call may read config() or attach a listener on this thread
// (lock_config() then takes nothing).
thread_local const caching_allocator* tls_config_holder = nullptr;

class config_hold {
 public:
  config_hold(std::mutex& m, const caching_allocator* a) : lock_(m), previous_(std::exchange(tls_config_holder, a)) {}
  ~config_hold() { tls_config_holder = previous_; }
  config_hold(const config_hold&) = delete;
  config_hold& operator=(const config_hold&) = delete;

 private:
  std::lock_guard<std::mutex> lock_;
  const caching_allocator* previous_;
};

// A mapping listener runs with its device's locks held (mapping_events.hpp):
// what changes the devices' configuration would wait for itself there.
void refuse_inside_mapping_listener(const char* what) {
  if (detail::tls_mapping_listener_depth != 0 && detail::tls_locked_callback != nullptr) [[unlikely]]
    throw invalid_argument_error(detail::locked_callback_message(what));
  if (detail::tls_mapping_listener_depth != 0) [[unlikely]]
    throw invalid_argument_error(std::string("ccalloc: ") + what +
                " called from a mapping listener; a listener must not call into any ccalloc allocator "
                "(ccalloc/core/mapping_events.hpp)");
}

using detail::pointer_text;

// A boolean environment variable: 1/true/yes/on and 0/false/no/off (any
// case); unset or empty is false. Anything else is a config_error naming it.
bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return false;
  std::string value(v);
  for (char& c : value) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (value == "1" || value == "true" || value == "yes" || value == "on") return true;
  if (value == "0" || value == "false" || value == "no" || value == "off") return false;
  throw config_error(std::string("ccalloc: ") + name + "=" + printable_text(v) +
                     " is not a boolean (accepted: 1, true, yes, on, 0, false, no, off)");
}

}  // namespace

void data_ptr_deleter::operator()(void* ptr) const {
  if (owner != nullptr) owner->free(ptr);
}

caching_allocator::caching_allocator(std::shared_ptr<device_backend> backend)
    : caching_allocator(std::move(backend), allocator_config::from_environment()) {
  caching_enabled_ = !env_flag("CCALLOC_NO_CACHING");
  // CCALLOC_CONF is the process's: its warnings are printed by the first
  // allocator that reads a given value, not by each one made from it.
  static std::mutex printed_mutex;
  static std::string printed;  // the CCALLOC_CONF whose warnings were printed
  const char* const text = std::getenv("CCALLOC_CONF");
  std::lock_guard lock(printed_mutex);
  if (config_.warnings.empty() || (text != nullptr && printed == text)) return;
  print_warnings(config_);
  printed = text == nullptr ? "" : text;
}

caching_allocator::caching_allocator(std::shared_ptr<device_backend> backend, allocator_config config)
    : backend_(std::move(backend)), config_(std::move(config)) {
  if (!backend_) throw invalid_argument_error("ccalloc: caching_allocator needs a backend, got null");
  ipc_ = std::make_unique<detail::ipc_cache>(*backend_);
  exports_ = std::make_unique<detail::ipc_exports>();
  exports_->count = &ipc_export_count_;
  // A fork locks what this front end's calls lock before its devices' locks
  // (the configuration, then the IPC exports, whose holder frees blocks,
  // then the IPC imports), and its pointer map's shards, which are held
  // while taking no other lock, after them.
  fork_front_.emplace(detail::fork_rank::front_end,
                      detail::fork_hooks{this,
                                         [](void* self) noexcept {
                                           auto& a = *static_cast<caching_allocator*>(self);
                                           a.config_mutex_.lock();
                                           a.exports_->mutex.lock();
                                           a.ipc_->mutex.lock();
                                         },
                                         [](void* self, bool) noexcept {
                                           auto& a = *static_cast<caching_allocator*>(self);
                                           a.ipc_->mutex.unlock();
                                           a.exports_->mutex.unlock();
                                           a.config_mutex_.unlock();
                                         }});
  fork_shards_.emplace(detail::fork_rank::leaf,
                       detail::fork_hooks{this,
                                          [](void* self) noexcept {
                                            for (pointer_shard& s : static_cast<caching_allocator*>(self)->shards_)
                                              s.mutex.lock();
                                          },
                                          [](void* self, bool) noexcept {
                                            for (pointer_shard& s : static_cast<caching_allocator*>(self)->shards_)
                                              s.mutex.unlock();
                                          }});
}

void caching_allocator::print_warnings(const allocator_config& config) {
  for (const std::string& w : config.warnings) std::fprintf(stderr, "ccalloc: warning: %s\n", w.c_str());
}

caching_allocator::~caching_allocator() = default;

void caching_allocator::init(int device_count) {
  if (device_count > max_device_count)
    throw invalid_argument_error("ccalloc: init(" + std::to_string(device_count) + "): at most " +
                                 std::to_string(max_device_count) + " devices (ccalloc::max_device_count)");
  if (device_count < 1)
    throw invalid_argument_error("ccalloc: init(" + std::to_string(device_count) +
                                 "): device_count must be at least 1 (the devices to drive, from 0)");
  if (device_count > backend_->device_count())
    throw invalid_argument_error("ccalloc: init(" + std::to_string(device_count) + "): the '" +
                                 backend_->name() + "' backend has " +
                                 std::to_string(backend_->device_count()) + " device(s)");
  refuse_inside_mapping_listener("init()");
  std::lock_guard lock(config_mutex_);
  for (int d = static_cast<int>(devices_.size()); d < device_count; ++d) {
    auto dev = std::make_unique<device_caching_allocator>(d, *backend_, config_);
    if (!caching_enabled_) dev->set_caching_enabled(false);
    for (auto& o : observers_) dev->attach_oom_observer(o);
    if (history_options_.enabled) dev->record_history(history_options_);
    for (auto& t : trackers_) dev->attach_trace_tracker(t);
    for (auto& l : mapping_listeners_) dev->attach_mapping_listener(l);
    if (!user_metadata_.empty()) dev->set_user_metadata(user_metadata_);
    devices_.push_back(std::move(dev));
  }
}

bool caching_allocator::initialized() const noexcept { return !devices_.empty(); }

mempool_id_t caching_allocator::new_pool_id() noexcept {
  // One counter for the process: C++, the C API and Python draw from it.
  static std::atomic<std::uint64_t> next{1};
  return mempool_id_t{next.fetch_add(1, std::memory_order_relaxed), 0};
}

device_caching_allocator& caching_allocator::checked_device(int device, const char* what) const {
  // Each call naming a device takes some of its locks, which a thread
  // running mapping listeners holds: refused here, before any lock, rather
  // than stopping the process on the lock (ccalloc/core/mapping_events.hpp).
  if (detail::tls_mapping_listener_depth != 0 && detail::tls_locked_callback != nullptr) [[unlikely]]
    throw invalid_argument_error(detail::locked_callback_message(what));
  if (detail::tls_mapping_listener_depth != 0) [[unlikely]]
    throw invalid_argument_error(std::string("ccalloc: ") + what +
                                 ": a mapping listener called into the allocator, whose locks the announcing thread "
                                 "holds; a listener must not call into any ccalloc allocator "
                                 "(ccalloc/core/mapping_events.hpp)");
  if (devices_.empty())
    throw invalid_argument_error(std::string("ccalloc: ") + what + " before init(): call init(device_count) first");
  if (device < 0 || device >= static_cast<int>(devices_.size()))
    throw invalid_argument_error(std::string("ccalloc: ") + what + ": device " + std::to_string(device) +
                                 " is not initialized (devices 0.." + std::to_string(devices_.size() - 1) + ")");
  return *devices_[static_cast<std::size_t>(device)];
}

device_caching_allocator& caching_allocator::device_allocator(int device) const {
  return checked_device(device, "device_allocator");
}

std::optional<caching_allocator::pointer_entry> caching_allocator::find_entry(void* ptr) const {
  auto& shard = shard_for(ptr);
  std::lock_guard lock(shard.mutex);
  const pointer_entry* e = shard.blocks.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (e == nullptr) return std::nullopt;
  return *e;
}

// malloc, free and shard_for are inline (caching_allocator.hpp): the caller
// (the C API, a program) then calls the device allocator's malloc or free
// directly, one function call per operation fewer.

void caching_allocator::throw_not_live(void* ptr) {
  throw invalid_argument_error("ccalloc: free(" + pointer_text(ptr) +
                               "): not a live allocation of this allocator (never allocated here, "
                               "already freed, or not the start of an allocation)");
}

void caching_allocator::create_or_incref_pool(int device, mempool_id_t id, segment_allocator custom) {
  checked_device(device, "create_or_incref_pool").create_or_incref_pool(id, std::move(custom));
}

void caching_allocator::release_pool(int device, mempool_id_t id) {
  checked_device(device, "release_pool").release_pool(id);
}

int caching_allocator::get_pool_use_count(int device, mempool_id_t id) const {
  return checked_device(device, "get_pool_use_count").get_pool_use_count(id);
}

void caching_allocator::begin_allocate_to_pool(int device, mempool_id_t id, stream_filter filter) {
  checked_device(device, "begin_allocate_to_pool").begin_allocate_to_pool(id, std::move(filter));
}

void caching_allocator::end_allocate_to_pool(int device, mempool_id_t id) {
  checked_device(device, "end_allocate_to_pool").end_allocate_to_pool(id);
}

void caching_allocator::set_use_on_oom(int device, mempool_id_t id, bool enabled) {
  checked_device(device, "set_use_on_oom").set_use_on_oom(id, enabled);
}

void caching_allocator::set_no_split(int device, mempool_id_t id, bool enabled) {
  checked_device(device, "set_no_split").set_no_split(id, enabled);
}

bool caching_allocator::check_pool_live_allocations(int device, mempool_id_t id,
                                                    const std::vector<void*>& expected) const {
  return checked_device(device, "check_pool_live_allocations").check_pool_live_allocations(id, expected);
}

pool_usage caching_allocator::get_pool_stats(int device, mempool_id_t id) const {
  return checked_device(device, "get_pool_stats").pool_stats(id);
}

pool_checkpoint caching_allocator::get_checkpoint_state(int device, mempool_id_t id) const {
  return checked_device(device, "get_checkpoint_state").get_checkpoint_state(id);
}

checkpoint_restore_result caching_allocator::set_checkpoint_pool_state(int device, const pool_checkpoint& state) {
  checkpoint_restore_result r = checked_device(device, "set_checkpoint_pool_state").set_checkpoint_pool_state(state);
  for (void* p : r.freed_pointers) {
    auto& shard = shard_for(p);
    std::lock_guard lock(shard.mutex);
    pointer_entry unused;
    (void)shard.blocks.erase(reinterpret_cast<std::uintptr_t>(p), &unused);
  }
  for (const allocation& a : r.blocks_created) {
    auto& shard = shard_for(a.ptr);
    std::lock_guard lock(shard.mutex);
    shard.blocks.insert(reinterpret_cast<std::uintptr_t>(a.ptr), pointer_entry{device, a.block});
  }
  return r;
}

data_ptr caching_allocator::allocate(std::size_t size_bytes) {
  return data_ptr(raw_alloc(size_bytes), data_ptr_deleter{this});
}

raw_deleter_fn caching_allocator::raw_deleter() noexcept {
  return [](void* ptr) { global_allocator().free(ptr); };
}

void* caching_allocator::raw_alloc(std::size_t size_bytes) {
  return malloc(backend_->current_device(), size_bytes, tls_current_stream);
}

void* caching_allocator::raw_alloc_with_stream(std::size_t size_bytes, stream_t stream) {
  return malloc(backend_->current_device(), size_bytes, stream);
}

void caching_allocator::raw_delete(void* ptr) { free(ptr); }

void caching_allocator::set_current_stream(stream_t stream) noexcept { tls_current_stream = stream; }
stream_t caching_allocator::current_stream() noexcept { return tls_current_stream; }

void caching_allocator::enable(bool enabled) {
  refuse_inside_mapping_listener("enable()");
  config_hold hold(config_mutex_, this);
  for (std::size_t i = 0; i < devices_.size(); ++i) {
    try {
      devices_[i]->set_caching_enabled(enabled);
    } catch (...) {
      // Only turning caching off can fail (returning a device's cache); turn
      // it back on for the devices already switched: all or nothing.
      for (std::size_t j = 0; j < i; ++j) devices_[j]->set_caching_enabled(!enabled);
      throw;
    }
  }
  caching_enabled_ = enabled;
}

bool caching_allocator::is_enabled() const noexcept { return caching_enabled_.load(std::memory_order_relaxed); }

void caching_allocator::set_memory_fraction(double fraction, int device) {
  checked_device(device, "set_memory_fraction").set_memory_fraction(fraction);
}

double caching_allocator::get_memory_fraction(int device) const {
  return checked_device(device, "get_memory_fraction").memory_fraction();
}

namespace {
void add_result(sleep_result& into, sleep_result&& r) {
  for (std::string& t : r.tags)
    if (std::find(into.tags.begin(), into.tags.end(), t) == into.tags.end()) into.tags.push_back(std::move(t));
  into.released_bytes += r.released_bytes;
  into.paused_bytes += r.paused_bytes;
  into.copied_bytes += r.copied_bytes;
  into.cache_released_bytes += r.cache_released_bytes;
  into.host_time_us += r.host_time_us;
}
}  // namespace

sleep_result caching_allocator::pause(const std::vector<std::string>& tags, bool keep_contents, int device) {
  sleep_result out;
  if (device != -1) return checked_device(device, "pause").pause(tags, keep_contents);
  (void)checked_device(0, "pause");
  // Room for the merged names first: a merge that ran out of host memory
  // after a device paused would report a pause that happened as failed.
  out.tags.reserve(tags.size());
  for (auto& d : devices_) add_result(out, d->pause(tags, keep_contents));
  return out;
}

sleep_result caching_allocator::resume(const std::vector<std::string>& tags, int device) {
  sleep_result out;
  if (device != -1) return checked_device(device, "resume").resume(tags);
  (void)checked_device(0, "resume");
  out.tags.reserve(tags.size());  // as pause
  for (auto& d : devices_) add_result(out, d->resume(tags));
  return out;
}

std::vector<tag_usage> caching_allocator::tag_stats(int device) const {
  return checked_device(device, "tag_stats").tag_stats();
}

std::vector<std::string> caching_allocator::paused_tags(int device) const {
  return checked_device(device, "paused_tags").paused_tags();
}

void caching_allocator::empty_cache() {
  std::exception_ptr first_failure;  // a device that fails does not keep the others' caches
  // Exported blocks freed by their owner and no longer held go back first,
  // so that their pages are released with the rest.
  try {
    (void)reclaim_ipc_exports();
  } catch (...) {
    first_failure = std::current_exception();
  }
  for (auto& d : devices_) {
    try {
      d->empty_cache();
    } catch (...) {
      if (!first_failure) first_failure = std::current_exception();
    }
  }
  if (first_failure) std::rethrow_exception(first_failure);
}

void caching_allocator::enable_peer_access(int device, int peer) {
  (void)checked_device(device, "enable_peer_access");
  device_caching_allocator& owner = checked_device(peer, "enable_peer_access (peer)");
  if (device == peer)
    throw invalid_argument_error("ccalloc: enable_peer_access: device " + std::to_string(device) +
                                 " and its peer are the same device");
  if (!backend_->can_access_peer(device, peer))
    throw backend_error("ccalloc: enable_peer_access: device " + std::to_string(device) +
                        " cannot access device " + std::to_string(peer) + " on the '" + backend_->name() +
                        "' backend (no peer-to-peer path)");
  backend_->enable_peer_access(device, peer);
  owner.enable_peer_access(device);
}

std::vector<expandable_segment_info> caching_allocator::expandable_segment_sizes(int device) const {
  return checked_device(device, "expandable_segment_sizes").expandable_segments();
}

std::size_t caching_allocator::cache_info(int device) const {
  return checked_device(device, "cache_info").largest_free_block();
}

std::pair<void*, std::size_t> caching_allocator::get_base_allocation(void* ptr) const {
  const auto entry = find_entry(ptr);
  if (!entry)
    throw invalid_argument_error("ccalloc: get_base_allocation(" + pointer_text(ptr) +
                                 "): not a live allocation of this allocator");
  return devices_[static_cast<std::size_t>(entry->device)]->base_allocation(entry->block);
}

// Devices not initialized yet have nothing to tell (streams may be made before init).
stream_t caching_allocator::create_stream(int device) {
  const stream_t stream = backend_->create_stream(device);
  if (device >= 0 && device < static_cast<int>(devices_.size()))
    devices_[static_cast<std::size_t>(device)]->stream_created(stream);
  return stream;
}

void caching_allocator::destroy_stream(int device, stream_t stream) {
  device_caching_allocator* dev = device >= 0 && device < static_cast<int>(devices_.size())
                                      ? devices_[static_cast<std::size_t>(device)].get()
                                      : nullptr;
  if (dev == nullptr) {
    backend_->destroy_stream(device, stream);
    return;
  }
  if (stream == default_stream || device_backend::is_per_thread_stream(stream) || !backend_->is_stream(device, stream))
    throw invalid_argument_error("ccalloc: destroy_stream: stream " + std::to_string(stream) + " of device " +
                                 std::to_string(device) +
                                 " is not a stream that create_stream made (never created, already destroyed, "
                                 "or a default stream)");
  // Destroyed under the device's lock: no malloc finds the stream gone for
  // the allocator and live for the backend (it would make it live again).
  dev->stream_destroyed(stream, [&] { backend_->destroy_stream(device, stream); });
}

void caching_allocator::record_stream(void* ptr, stream_t stream) {
  if (ptr == nullptr) return;
  if (const auto entry = find_entry(ptr)) {
    devices_[static_cast<std::size_t>(entry->device)]->record_stream(
        entry->block, backend_->resolve_stream(entry->device, stream));
    return;
  }
  // Not the start of a block: maybe a view inside one (SPEC X4); else not
  // ours, and ignored (F11).
  for (std::size_t i = 0; i < devices_.size(); ++i)
    if (devices_[i]->record_stream_containing(reinterpret_cast<std::uintptr_t>(ptr),
                                              backend_->resolve_stream(static_cast<int>(i), stream)))
      return;
}

device_stats caching_allocator::get_device_stats(int device) const {
  return checked_device(device, "get_device_stats").stats();
}

void caching_allocator::reset_accumulated_stats(int device) {
  checked_device(device, "reset_accumulated_stats").reset_accumulated_stats();
}

void caching_allocator::reset_peak_stats(int device) {
  checked_device(device, "reset_peak_stats").reset_peak_stats();
}

void caching_allocator::attach_out_of_memory_observer(oom_observer observer) {
  std::lock_guard lock(config_mutex_);
  observers_.push_back(observer);
  for (auto& d : devices_) d->attach_oom_observer(observer);
}

void caching_allocator::record_history(const history_options& options) {
  if (options.max_entries == 0)
    throw invalid_argument_error("ccalloc: record_history: max_entries must be at least 1, got 0");
  refuse_inside_mapping_listener("record_history()");
  std::lock_guard lock(config_mutex_);
  history_options_ = options;
  history_options_.clear = false;  // devices added later start empty anyway
  for (auto& d : devices_) d->record_history(options);
}

bool caching_allocator::is_history_enabled() const {
  const auto lock = lock_config();
  return history_options_.enabled;
}

void caching_allocator::record_annotation(std::vector<std::pair<std::string, std::string>> metadata) {
  checked_device(backend_->current_device(), "record_annotation").record_annotation(std::move(metadata));
}

void caching_allocator::push_compile_context(std::string context) {
  for (auto& d : devices_) d->push_compile_context(context);
}

void caching_allocator::pop_compile_context() {
  for (auto& d : devices_) d->pop_compile_context();
}

void caching_allocator::set_user_metadata(const std::string& metadata) {
  refuse_inside_mapping_listener("set_user_metadata()");
  std::lock_guard lock(config_mutex_);
  user_metadata_ = metadata;
  for (auto& d : devices_) d->set_user_metadata(metadata);
}

std::string caching_allocator::get_user_metadata() const {
  const auto lock = lock_config();
  return user_metadata_;
}

void caching_allocator::attach_allocator_trace_tracker(trace_tracker tracker) {
  if (!tracker) throw invalid_argument_error("ccalloc: attach_allocator_trace_tracker: the tracker is empty");
  std::lock_guard lock(config_mutex_);
  trackers_.push_back(tracker);
  for (auto& d : devices_) d->attach_trace_tracker(tracker);
}

void caching_allocator::attach_mapping_listener(mapping_listener listener) {
  if (!listener) throw invalid_argument_error("ccalloc: attach_mapping_listener: the listener is empty");
  const auto lock = lock_config();
  mapping_listeners_.push_back(listener);
  for (auto& d : devices_) d->attach_mapping_listener(listener);
}

void caching_allocator::attach_mapping_listener(
    mapping_listener listener, const std::function<void(const std::vector<segment_info>&)>& listed) {
  if (!listener) throw invalid_argument_error("ccalloc: attach_mapping_listener: the listener is empty");
  const auto lock = lock_config();
  mapping_listeners_.push_back(listener);
  for (auto& d : devices_) d->attach_mapping_listener(listener, listed);
}

void caching_allocator::record_snapshot_entry() const {
  for (auto& d : devices_) d->record_snapshot_entry();
}

memory_snapshot caching_allocator::snapshot(bool include_traces, bool record_entry) const {
  memory_snapshot out;
  out.config = config();
  for (auto& d : devices_) {
    std::vector<segment_info> segments = d->snapshot_segments(record_entry);
    out.segments.insert(out.segments.end(), std::make_move_iterator(segments.begin()),
                        std::make_move_iterator(segments.end()));
    out.device_traces.push_back(include_traces ? d->trace_entries() : std::vector<trace_entry>{});
    std::vector<annotation_entry> annotations = d->annotations();
    out.external_annotations.insert(out.external_annotations.end(), std::make_move_iterator(annotations.begin()),
                                    std::make_move_iterator(annotations.end()));
  }
  return out;
}

void caching_allocator::set_config(std::string_view text) {
  refuse_inside_mapping_listener("set_config()");
  config_hold hold(config_mutex_, this);
  allocator_config next = config_;
  next.apply(text);  // throws config_error; nothing changed then
  // Only what this setting adds: the warnings of earlier settings that
  // still hold were printed when those were made.
  for (const std::string& w : next.warnings)
    if (std::find(config_.warnings.begin(), config_.warnings.end(), w) == config_.warnings.end())
      std::fprintf(stderr, "ccalloc: warning: %s\n", w.c_str());
  config_ = next;
  for (auto& d : devices_) d->set_config(config_);
}

std::unique_lock<std::mutex> caching_allocator::lock_config() const {
  if (tls_config_holder == this) return {};  // this thread holds it: a listener inside enable()/set_config()
  return std::unique_lock(config_mutex_);
}

allocator_config caching_allocator::config() const {
  const auto lock = lock_config();
  return config_;
}

caching_allocator& global_allocator() {
  // Leaked on purpose: pointers may be freed during static destruction.
  static caching_allocator* instance = [] {
    auto* a = new caching_allocator(make_default_backend());
    a->init(a->backend().device_count());
    return a;
  }();
  return *instance;
}

}  // namespace ccalloc
