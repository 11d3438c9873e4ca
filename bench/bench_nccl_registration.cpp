// NCCL register calls per training step with nccl_registration (SPEC C2), on
// replays of traces on the simulated device, against a counting stub NCCL.
//
//   bench_nccl_registration TRACE... [--repeat N]
//
// Each trace is replayed N times back to back as one program (a pass = one
// recorded program, the steps it holds). One communicator is added at the
// first event; at the end of each pass the runtime flushes (registers every
// mapped run: the buffers a step's collectives could use). Printed per trace:
// map and unmap announcements and the pages mapped (registering at each map
// would cost one register call per map, page by page one per page), and the
// register / deregister calls of the helper, for the first pass and per pass
// after it.
#include <ccalloc/frontend/caching_allocator.hpp>
#include <ccalloc/frontend/nccl_registration.hpp>
#include <ccalloc/replay/replay.hpp>
#include <ccalloc/replay/trace.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

std::uintptr_t next_handle = 1;
int count_register(void* /*comm*/, void* /*buff*/, std::size_t /*size*/, void** handle) {
  *handle = reinterpret_cast<void*>(next_handle++);
  return 0;
}
int count_deregister(void* /*comm*/, void* /*handle*/) { return 0; }

struct pass_figures {
  std::uint64_t maps = 0, pages = 0, unmaps = 0, registers = 0;
};

}  // namespace

int main(int argc, char** argv) {
  std::size_t repeat = 4;
  std::vector<std::string> paths;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--repeat") == 0 && i + 1 < argc) repeat = std::strtoul(argv[++i], nullptr, 10);
    else paths.emplace_back(argv[i]);
  }
  if (paths.empty() || repeat < 2) {
    std::fprintf(stderr, "usage: bench_nccl_registration TRACE... [--repeat N >= 2]\n");
    return 2;
  }
  std::printf("trace,events,maps_first_pass,register_first_pass,maps_per_later_pass,pages_per_later_pass,"
              "unmaps_per_later_pass,register_per_later_pass,deregister_per_pass\n");
  for (const std::string& path : paths) {
    const ccalloc::trace t = ccalloc::read_trace_file(path);
    const std::size_t events = t.events.size();
    std::unique_ptr<ccalloc::nccl_registration> reg;
    std::vector<pass_figures> passes(repeat);
    std::size_t pass = 0;
    int comm = 0;
    ccalloc::replay_options o;
    o.repeat = repeat;
    o.after_event = [&](std::size_t index, ccalloc::caching_allocator& alloc) {
      if (!reg) {
        reg = std::make_unique<ccalloc::nccl_registration>(
            alloc, ccalloc::nccl_functions{&count_register, &count_deregister});
        reg->add_communicator(&comm, 0);
        alloc.attach_mapping_listener([&](const ccalloc::mapping_event& e) {
          if (e.change == ccalloc::mapping_change::map) {
            ++passes[pass].maps;
            passes[pass].pages += e.expandable ? e.size_bytes / (2 * ccalloc::mib) : 1;
          }
          if (e.change == ccalloc::mapping_change::unmap) ++passes[pass].unmaps;
        });
      }
      if ((index + 1) % events == 0) {  // the end of a pass: the step's collectives
        const auto before = reg->stats();
        reg->flush();
        const auto after = reg->stats();
        passes[pass].registers += after.register_calls - before.register_calls;
        pass = std::min(pass + 1, repeat - 1);
      }
      return true;
    };
    (void)ccalloc::replay_trace(t, o);
    const auto total = reg->stats();
    pass_figures later;
    for (std::size_t p = 1; p < repeat; ++p) {
      later.maps += passes[p].maps;
      later.pages += passes[p].pages;
      later.unmaps += passes[p].unmaps;
      later.registers += passes[p].registers;
    }
    const double n = static_cast<double>(repeat - 1);
    std::printf("%s,%zu,%llu,%llu,%.1f,%.1f,%.1f,%.1f,%.1f\n", path.c_str(), events,
                static_cast<unsigned long long>(passes[0].maps), static_cast<unsigned long long>(passes[0].registers),
                static_cast<double>(later.maps) / n, static_cast<double>(later.pages) / n,
                static_cast<double>(later.unmaps) / n,
                static_cast<double>(later.registers) / n, static_cast<double>(total.deregister_calls) / static_cast<double>(repeat));
    reg.reset();
  }
  return 0;
}
