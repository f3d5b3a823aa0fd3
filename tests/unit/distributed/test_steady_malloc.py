"""`steady_malloc` (what `configure_process` does on CPU): memory a step frees is kept for the next, so
a step that allocates and frees the same blocks again faults in no fresh pages."""

import subprocess
import sys

BLOCK_PAGES = (8 << 20) // 4096

# After the import (whose frees move glibc's default thresholds), each step allocates, touches and
# frees two 8 MiB tensors; the process prints the page faults of 5 steps after a first one.
STEPS = """
import resource
import torch
from megarl.distributed.process import steady_malloc

steady_malloc()

def step():
    blocks = [torch.empty(2 << 20).fill_(1.0) for _ in range(2)]
    del blocks

step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_freed_blocks_are_reused_without_fresh_pages():
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", STEPS], capture_output=True, text=True, check=True)
    faults = int(result.stdout.split()[-1])
    # glibc's defaults hand the blocks back at each free: 5 steps x 2 blocks x 2048 pages (20,322 seen).
    assert faults < 2 * BLOCK_PAGES, faults
