"""Partial rollouts' bookkeeping per engine step at verl's batch sizes, against its floor.

    python bench/partial_bookkeeping.py [--groups 64 512] [--samples 16] [--response-length 64] [--steps 6]
                                        [--nproc 1 2]

`PartialRollouts` (`megarl.generation.partial`, split placement's continuous generation) keeps `--groups`
prompts of `--samples` responses in flight over engine replicas that answer at once: each engine step gives
every request one token, and a request ends at the length limit or, with probability 1/32 a token, at a stop
(decided by a hash of its key and length, so the same on every layout). One torchrun process a replica, one
thread each; each process times `--steps` batches taken (`take`, the next one filled, a pause as before a
weight sync) after one of warm-up, the start-up's objects frozen as the trainer freezes them. Reported, rank
0's median over the batches:

- bookkeeping: an engine step's wall clock less the engines' own time (admission, submission, each token of
  the rank's own replica appended to its response, the ended requests' tokens exchanged between the replicas,
  and the batch's scoring, spread over its engine steps);
- floor: what any bookkeeping must do on a rank: append its replica's share of the tokens (one a request in
  flight, over the replicas) to their responses in a plain loop. bookkeeping / floor is the ratio printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs/bench/partial_bookkeeping"
MARKER = "PARTIAL_BOOKKEEPING"
STOP_ONE_IN = 32
"""A request stops at a token with probability 1 / STOP_ONE_IN."""


class InstantEngine:
    """A `RolloutEngine` that samples at once: one token per request per step, timing its own steps."""

    def __init__(self):
        self.requests: dict[str, list[int]] = {}
        """Per request: tokens given so far, and how many it may have."""
        self.seconds, self.steps = 0.0, 0

    def submit(self, key: str, prompt: list[int], sampling) -> None:
        self.requests[key] = [0, sampling.max_tokens]

    def abort(self, keys) -> None:
        for key in keys:
            self.requests.pop(key, None)

    def step(self):
        from megarl.rollout.base import Advance

        start = time.perf_counter()
        advances = []
        for key, budget in list(self.requests.items()):
            budget[0] += 1
            reason = ("length" if budget[0] == budget[1] else
                      "stop" if zlib.crc32(f"{key}/{budget[0]}".encode()) % STOP_ONE_IN == 0 else None)
            advances.append(Advance(key, [5], [-0.5], reason))
            if reason is not None:
                del self.requests[key]
        self.seconds += time.perf_counter() - start
        self.steps += 1
        return advances


def floor_ms(count: int, rounds: int = 21) -> float:
    """Median ms to append one token and its log-prob and version to each of `count` responses."""
    from megarl.generation.partial import Response
    from megarl.rollout.base import Advance

    responses = {f"{i}": Response() for i in range(count)}
    advances = [Advance(key, [5], [-0.5], None) for key in responses]
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for advance in advances:
            response = responses[advance.key]
            response.ids += advance.ids
            response.logprobs += advance.logprobs
            response.versions += [0] * len(advance.ids)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def worker(args) -> None:
    import torch.distributed as dist

    from megarl.config.loader import load_config
    from megarl.distributed.process import freeze_start_up_objects
    from megarl.generation.inputs import RunInputs
    from megarl.generation.partial import PartialRollouts
    from megarl.tracking.console import quiet_third_party_logs

    quiet_third_party_logs()
    dist.init_process_group("gloo")
    groups = args.groups[0]
    config = load_config(str(ROOT / "configs/quickstart.yaml"), [
        f"model.path={args.model}", f"data.train_files=[{args.train}]", f"data.val_files=[{args.train}]",
        "trainer.placement=split", f"rollout.num_ranks={dist.get_world_size()}", "trainer.max_staleness=2",
        "rollout.partial=true", f"data.max_response_length={args.response_length}",
        f"data.train_batch_size={groups}", f"rollout.n={args.samples}"])
    inputs = RunInputs.open(config)
    engine = InstantEngine()
    partial = PartialRollouts(config, inputs.tokenizer, inputs.rewards, inputs.train_data, inputs.sampler, engine)
    per_step = []
    for step in range(1, args.steps + 2):
        if step == 2:
            freeze_start_up_objects()
        engine.seconds, engine.steps = 0.0, 0
        dist.barrier()
        start = time.perf_counter()
        partial.take(step, version=step - 1)
        partial.fill(step + 1, version=step - 1)
        wall = time.perf_counter() - start
        partial.pause(keep=False)
        if step > 1:
            per_step.append(1e3 * (wall - engine.seconds) / engine.steps)
    if dist.get_rank() == 0:
        in_flight = groups * args.samples
        print(MARKER + " " + json.dumps({"bookkeeping_ms": statistics.median(per_step), "in_flight": in_flight,
                                         "floor_ms": floor_ms(in_flight // dist.get_world_size())}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[64, 512], help="prompts in flight")
    parser.add_argument("--samples", type=int, default=16, help="responses per prompt")
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6, help="batches timed, after one of warm-up")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="engine replicas, a process each")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--train", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from common import ensure_quickstart_model, launch, torchrun

    OUT.mkdir(parents=True, exist_ok=True)
    model = ensure_quickstart_model(OUT)
    train = ROOT / "outputs/quickstart/data/train.parquet"
    print(f"partial rollouts, {args.samples} responses a prompt of <= {args.response_length} tokens, an engine that "
          f"answers at once; ms per engine step, rank 0, medians of {args.steps} batches")
    print(f"{'groups':>7} {'replicas':>9} {'bookkeeping':>12} {'floor':>7} {'ratio':>6} {'us / response':>14}")
    for groups in args.groups:
        for nproc in args.nproc:
            command = torchrun(nproc) + [__file__, "--worker", "--model", str(model), "--train", str(train),
                                         "--groups", str(groups), "--samples", str(args.samples), "--response-length",
                                         str(args.response_length), "--steps", str(args.steps)]
            result = launch(command, MARKER)
            ms, floor = result["bookkeeping_ms"], result["floor_ms"]
            print(f"{groups:>7} {nproc:>9} {ms:>12.2f} {floor:>7.2f} {ms / floor:>6.1f} "
                  f"{1e3 * ms / result['in_flight']:>14.2f}", flush=True)


if __name__ == "__main__":
    main()
