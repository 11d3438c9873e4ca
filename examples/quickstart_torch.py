"""The README's PyTorch quick start: ccalloc as PyTorch's CUDA allocator.
Needs PyTorch and a GPU (the test suite skips it, exit status 77, without)."""
import sys

try:
    import torch as _probe
    import ccalloc.torch as _installed  # the package from pip install (python/README.md)
    if not _probe.cuda.is_available():
        raise ImportError("no GPU")
except ImportError as e:
    print("skip:", e)
    sys.exit(77)

import ccalloc.torch; ccalloc.torch.install()    # first thing, before CUDA is used
import torch                                      # unchanged PyTorch code from here on

x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
del x                                             # cached for the next tensor
print("allocator:", torch.cuda.get_allocator_backend())
print("peak reserved:", torch.cuda.memory_stats()["reserved_bytes.all.peak"], "bytes")
