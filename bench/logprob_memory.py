"""Peak memory of log-prob + entropy (forward and backward): chunked kernel vs. full-vocab naive.

    python bench/logprob_memory.py [--tokens 1024] [--vocab 32000]

Each variant runs in a fresh process (one thread); its peak extra memory is the process's peak
RSS, reset once the (tokens, vocab) fp32 logits exist (computed by an output layer, as in a
training step), minus its RSS at that moment; it includes the gradient of the logits that the
output layer's backward receives. Target:
chunked / naive < 0.25 at vocab 32k and 1k tokens.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(variant: str, tokens: int, vocab: int, chunk_size: int, args_hidden: int = 256) -> None:
    import psutil
    import torch

    from megarl.kernels.vocab_parallel_logprobs import logprobs_and_entropy, reference_logprobs_and_entropy

    torch.manual_seed(0)
    # The model's output layer produces the logits, as in a training step; nothing reads them
    # after the loss, so the kernel may reuse their storage for their gradient.
    hidden = torch.randn(tokens, args_hidden, requires_grad=True)
    output_weight = (torch.randn(vocab, args_hidden) / args_hidden**0.5).requires_grad_()
    logits = hidden @ output_weight.T
    targets = torch.randint(0, vocab, (tokens,))
    weights = torch.randn(tokens)
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS (Linux), so that earlier
    baseline = psutil.Process().memory_info().rss  # peaks (imports, the logits' matmul) do not count
    start = time.perf_counter()
    if variant == "chunked":
        logprob, entropy = logprobs_and_entropy(logits, targets, chunk_size=chunk_size, inplace_backward=True)
    else:
        logprob, entropy = reference_logprobs_and_entropy(logits, targets, vocab)
    (logprob * weights + 0.01 * entropy).sum().backward()
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    print(f"{(peak - baseline) / 2**20:.1f} {seconds:.3f}")


def peak_rss_bytes() -> int:
    """The process's peak resident set since the last reset (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status: this benchmark needs Linux")


def run(variant: str, args) -> tuple[float, float]:
    command = [sys.executable, __file__, "--measure", variant, "--tokens", str(args.tokens),
               "--vocab", str(args.vocab), "--chunk-size", str(args.chunk_size)]
    # Allocations of 64 KiB and more get their own mappings, returned to the OS when freed: RSS then
    # follows live tensors. With glibc's default heap, freed blocks stay resident and the peak varied
    # run to run by tens of MiB.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    output = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout.split()
    return float(output[0]), float(output[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--measure", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure, args.tokens, args.vocab, args.chunk_size)
        return
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    naive_mib, naive_s = run("naive", args)
    chunked_mib, chunked_s = run("chunked", args)
    print(f"tokens {args.tokens}, vocab {args.vocab}, fp32 logits {logits_mib:.0f} MiB, chunk {args.chunk_size} rows")
    print(f"naive   full-vocab log_softmax: peak extra {naive_mib:8.1f} MiB  fwd+bwd {naive_s:.3f} s")
    print(f"chunked vocab-parallel kernel : peak extra {chunked_mib:8.1f} MiB  fwd+bwd {chunked_s:.3f} s")
    ratio = chunked_mib / naive_mib
    print(f"peak memory ratio chunked/naive = {ratio:.3f} (target < 0.25: {'met' if ratio < 0.25 else 'MISSED'}); "
          f"time ratio = {chunked_s / naive_s:.2f}")


if __name__ == "__main__":
    main()
