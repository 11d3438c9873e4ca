"""pytest setup: import ccalloc from this checkout (python/) and find
libccalloc.so in a build tree when CCALLOC_LIBRARY is not set; fixtures for
the sizes of segments."""
import os
import sys
from pathlib import Path

import pytest

PYTHON_DIR = Path(__file__).resolve().parents[1]
REPO = PYTHON_DIR.parent
sys.path.insert(0, str(PYTHON_DIR))

if "CCALLOC_LIBRARY" not in os.environ:
    for build in sorted(REPO.glob("build*/libccalloc.so")):
        os.environ["CCALLOC_LIBRARY"] = str(build)
        break

# The page size of expandable segments: the simulated device's granularity
# (CUDA's on the GPUs ccalloc targets, the H200 among them).
PAGE_BYTES = 2 << 20


@pytest.fixture
def reservation_bytes():
    """A function (allocator, device=0) -> the size in bytes of an expandable
    segment's reservation there: the device's total memory rounded up to
    whole pages. get_base_allocation gives it for any block of the segment."""
    def size(allocator, device=0):
        total = allocator.mem_get_info(device)[1]
        return -(-total // PAGE_BYTES) * PAGE_BYTES
    return size


@pytest.fixture
def process_wide_expandable():
    """Whether the process-wide allocator uses expandable segments: the
    default (the simulated device has virtual memory, and so do the GPUs
    ccalloc targets) unless CCALLOC_CONF sets expandable_segments:False."""
    import ccalloc
    return "expandable_segments:False" not in ccalloc.get_config()
