"""Opening a 1M-prompt parquet as the trainer does: start-up time and memory per rank.

    python bench/data_scale.py [--rows 1000000] [--small-rows 100000]

Writes synthetic `a+b=` prompts (`megarl.data.synthetic`, chat template of the tiny character
tokenizer, ~40 tokens a prompt), then opens them in fresh processes, each one rank: the eager way
megarl used before (every rank decodes every row and keeps every prompt's ids as Python lists) on
the small file, and `PromptDataset` (a tokenized Arrow cache built once per node, memory-mapped by
every rank) on both files, cold (two ranks start together: one builds, one waits and maps) and warm
(the cache exists: later runs, or ranks that start after the build). Each rank then reads 8 batches
of 256 prompts through the trainer's sampler.

Private memory is the growth of the process's anonymous resident memory (RssAnon): what each rank of a
node pays on its own. The mapped cache's pages count as file memory, shared by the ranks of a node
and reclaimable by the kernel; it is printed too. Target: a warm rank's private memory grows by at
most 20 bytes per extra row from --small-rows to --rows (16 expected: the dataset's int64 index of
kept prompts and the sampler's int64 epoch order; 4 for the allocator).
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "checkpoints_tools")]

MAX_PROMPT_LENGTH = 128
BATCHES, BATCH_SIZE = 8, 256


def memory_kib() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def eager_prompts(files: list[str], tokenizer) -> list:
    """What PromptDataset did before the cache: every row decoded and tokenized into Python lists."""
    from megarl.data import Prompt, load_rows
    from megarl.data.tokenization import prompt_ids

    rows = load_rows(files)
    ids = prompt_ids([row["prompt"] for row in rows], tokenizer, True, source=", ".join(files))
    return [Prompt(i, row["data_source"], row["reward_model"]["ground_truth"], row["extra_info"], index)
            for index, (row, i) in enumerate(zip(rows, ids)) if len(i) <= MAX_PROMPT_LENGTH]


def open_as_a_rank(how: str, file: str, cache_dir: str) -> dict:
    """One rank: open the data, read a few batches; seconds and memory growth (KiB)."""
    import make_tiny_model

    from megarl.data import PromptDataset, ResumableSampler

    tokenizer = make_tiny_model.make_tokenizer()
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS, so imports do not count
    before = memory_kib()
    start = time.perf_counter()
    if how == "eager":
        dataset, built = eager_prompts([file], tokenizer), 1
    else:
        dataset = PromptDataset([file], tokenizer, MAX_PROMPT_LENGTH, cache_dir=cache_dir)
        built = dataset.num_built
    open_seconds = time.perf_counter() - start
    sampler = ResumableSampler(len(dataset), BATCH_SIZE, seed=0)
    start = time.perf_counter()
    batches = [[dataset[i] for i in sampler.next_batch()] for _ in range(BATCHES)]
    read_seconds = time.perf_counter() - start
    assert all(len(batch) == BATCH_SIZE for batch in batches)
    after = memory_kib()
    return {"open_s": open_seconds, "batch_ms": 1000 * read_seconds / BATCHES, "built": built,
            "prompts": len(dataset), "private": after["RssAnon"] - before["RssAnon"],
            "file": after["RssFile"] - before["RssFile"], "peak": after["VmHWM"] - before["VmRSS"]}


def ranks(how: str, file: str, cache_dir: str, count: int) -> list[dict]:
    """`count` ranks started together, each a fresh process."""
    with multiprocessing.get_context("spawn").Pool(count) as pool:
        return pool.starmap(open_as_a_rank, [(how, file, cache_dir)] * count)


def write_data(rows: int, small_rows: int, out_dir: Path) -> tuple[str, str]:
    import pyarrow.parquet as pq

    from megarl.data.synthetic import make_arithmetic

    # max_operand 1999 gives 4M distinct questions; one test row is the least make_arithmetic writes
    big, _ = make_arithmetic(rows, 1, seed=0, max_operand=1999, out_dir=out_dir)
    small = str(out_dir / "small.parquet")
    pq.write_table(pq.read_table(big).slice(0, small_rows), small)
    return small, big


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--small-rows", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        small, big = write_data(args.rows, args.small_rows, Path(tmp))
        print(f"wrote {args.rows} + {args.small_rows} synthetic prompts in {time.perf_counter() - start:.0f} s; "
              f"{BATCHES} batches of {BATCH_SIZE} read per rank, max_prompt_length {MAX_PROMPT_LENGTH}")
        cache = str(Path(tmp) / "cache")
        results = [(args.small_rows, "eager (before): every rank", ranks("eager", small, cache, 1)[0])]
        for rows, file in ((args.small_rows, small), (args.rows, big)):
            first, second = sorted(ranks("mapped", file, cache, 2), key=lambda r: -r["built"])
            results += [(rows, "cache, cold: the rank that builds", first),
                        (rows, "cache, cold: the rank that waits", second),
                        (rows, "cache, warm: every rank", ranks("mapped", file, cache, 1)[0])]
    header = (f"{'rows':>9}  {'rank':<34} {'open s':>7} {'ms/batch':>8} {'private MiB':>11} {'B/row':>7} "
              f"{'peak MiB':>8} {'shared file MiB':>15}")
    print(header)
    for rows, name, r in results:
        print(f"{rows:>9}  {name:<34} {r['open_s']:>7.1f} {r['batch_ms']:>8.1f} {r['private'] / 1024:>11.1f} "
              f"{r['private'] * 1024 / rows:>7.1f} {r['peak'] / 1024:>8.1f} {r['file'] / 1024:>15.1f}")
    eager, warm_small, warm_big = results[0][2], results[3][2], results[6][2]
    print(f"private memory per row, warm cache / eager at {args.small_rows} rows: "
          f"{warm_small['private'] / eager['private']:.3f}")
    print(f"private memory growth from {args.small_rows} to {args.rows} rows (warm cache): "
          f"{warm_big['private'] / 1024:.1f} / {warm_small['private'] / 1024:.1f} MiB; "
          f"eager at {args.rows} rows would be ~{eager['private'] * args.rows / args.small_rows / 2**20:.1f} GiB")
    slope = (warm_big["private"] - warm_small["private"]) * 1024 / (args.rows - args.small_rows)
    eager_per_row = eager["private"] * 1024 / args.small_rows
    print(f"target: warm private memory per extra row <= 20 B (eager: {eager_per_row:.0f} B): "
          f"{slope:.1f} B ({'met' if slope <= 20 else 'MISSED'})")


if __name__ == "__main__":
    main()
