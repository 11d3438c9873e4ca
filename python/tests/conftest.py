"""pytest setup: import ccalloc from this checkout (python/) and find
libccalloc.so in a build tree when CCALLOC_LIBRARY is not set."""
import os
import sys
from pathlib import Path

PYTHON_DIR = Path(__file__).resolve().parents[1]
REPO = PYTHON_DIR.parent
sys.path.insert(0, str(PYTHON_DIR))

if "CCALLOC_LIBRARY" not in os.environ:
    for build in sorted(REPO.glob("build*/libccalloc.so")):
        os.environ["CCALLOC_LIBRARY"] = str(build)
        break
