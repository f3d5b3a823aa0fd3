"""The shared-memory collectives' kernels come from vLLM's build for this CPU's instruction set: where
the CPU lacks AVX-512, vLLM's AVX2 build, which has none of them, so megarl's collectives run on its own
segment (`SegmentGroup`), and the AVX-512 builds are never loaded (they die of an illegal instruction on
such a CPU)."""

import subprocess
import sys

# A CPU without AVX-512, as vLLM's platform sees it; the process prints whether megarl found the
# kernels and which of vLLM's kernel libraries it mapped.
AVX2_ONLY = """
from unittest import mock
import torch

with mock.patch.object(torch.cpu, "_is_avx512_supported", return_value=False):
    from megarl.distributed.shared_memory import _kernels_present
    present = _kernels_present()
libraries = {line.strip().rsplit("/", 1)[-1] for line in open("/proc/self/maps") if "/vllm/_C" in line}
print(present, sorted(libraries))
"""


def test_a_cpu_without_avx512_gets_vllms_avx2_kernels_and_no_shared_memory():
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", AVX2_ONLY], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[-2] == "False ['_C_AVX2.abi3.so']", result.stdout
