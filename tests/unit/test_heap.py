"""release_freed_memory gives a fragmented heap's free pages back (glibc, Linux)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from comap_async.heap import release_freed_memory, resident_gb

# Run in a child for a clean heap: 400 blocks of 96 KiB (under glibc's mmap threshold, so on the
# heap), then every other one freed: holes between live blocks, which free() cannot hand back (only
# a free top of the heap), as a learner step's variable-size activations leave them.
CHILD = """
import ctypes, json
from comap_async.heap import release_freed_memory, resident_gb
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
blocks = []
for _ in range(400):
    p = libc.malloc(96 * 1024)
    ctypes.memset(p, 1, 96 * 1024)
    blocks.append(p)
for p in blocks[::2]:  # holes between live blocks: nothing free reaches the heap's top
    libc.free(p)
before = resident_gb()
released = release_freed_memory()
print(json.dumps({"before": before, "after": resident_gb(), "released": released}))
"""


@pytest.mark.skipif(not release_freed_memory(), reason="needs glibc's malloc_trim (Linux)")
def test_trim_returns_freed_heap_pages_to_the_os():
    import json

    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["released"] is True
    # 200 holes x 96 KiB = 19.7 MB freed inside the heap: at least 15 MB of it leaves the resident set
    assert got["before"] - got["after"] > 0.015, got


def test_resident_set_is_read():
    rss = resident_gb()
    if sys.platform.startswith("linux"):
        assert rss is not None and 0.01 < rss < 1000
