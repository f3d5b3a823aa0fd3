"""A batch on its way from split placement's rollout ranks to its trainer ranks.

The first rollout rank holds a generated batch as a *payload* of plain values (`batch_payload`,
JSON-safe: the batches generated ahead go into checkpoints as they are). It crosses the bridge in two
parts, so a trainer rank receives O(its share) bytes, whatever the batch:

    header     every sequence's scalars (length, score, extras, finish reason; a multi-turn trajectory's
               opening length), the batch's counts and the age of its tokens' policy versions, broadcast to
               every rank: O(B) values, what the trainer needs to check staleness and deal the DP ranks' shares;
    responses  the token ids, log-probs (and a multi-turn trajectory's loss mask and opening) of the sequences
               each trainer rank trains on, one float64 tensor sent point-to-point from the first rollout rank
               (`pack_responses`), once trainer rank 0 has told it who wants which: never pickled, nothing sent
               twice to a rank.

    bridge = BatchBridge(world, dataset, n)
    bridge.send(payload)                              # rollout ranks (the first serves the responses)
    header, rollouts = bridge.receive()               # trainer ranks: no response held yet
    bridge.move(rollouts, wanted)                     # trainer ranks: rank r holds the responses of wanted[r]
"""

from __future__ import annotations

import torch

from megarl import device
from megarl.data.prompt_dataset import PromptDataset
from megarl.distributed.split_world import SplitWorld
from megarl.generation.rollouts import Rollouts, pack_responses, packed_size, unpack_responses

PER_TOKEN = ("response_ids", "logprobs", "token_versions", "loss_masks", "openings")
"""The payload's per-token columns: they travel as the responses, never in the header."""


class BatchBridge:
    def __init__(self, world: SplitWorld, dataset: PromptDataset, n: int):
        self.world, self.dataset, self.n = world, dataset, n
        self.source = world.first_rollout_rank
        self.on = device.compute_device()  # the bridge's backend takes this device's tensors

    def send(self, payload: dict) -> None:
        """The rollout ranks' part: the header to every rank, then (the first rollout rank) each trainer rank's
        responses as it asks."""
        header = batch_header(payload) if self.world.rank == self.source else None
        self.world.broadcast_object(header, self.source)
        if self.world.rank != self.source or payload["error"] is not None:
            return  # a batch whose rewards all failed stops the trainer at its header
        counts = self._received(torch.empty(self.world.num_trainer_ranks, dtype=torch.int64))
        rows = self._received(torch.empty(int(counts.sum()), dtype=torch.int64)).tolist()
        rollouts = _rollouts(header, self.dataset, self.n)
        rollouts.response_ids, rollouts.rollout_logprobs = payload["response_ids"], payload["logprobs"]
        rollouts.loss_masks, rollouts.openings = payload["loss_masks"], payload["openings"] or []
        works, start = [], 0
        for rank, count in enumerate(counts.tolist()):
            packed = pack_responses(rollouts, rows[start : start + count]).to(self.on)
            if packed.numel():  # the receiver knows the size too, and skips an empty message alike
                works.append(self.world.bridge.send([packed], rank, 0))
            start += count
        for work in works:
            work.wait()

    def receive(self) -> tuple[dict, Rollouts]:
        """The trainer ranks' part: the batch's header, and its rollouts with no response held yet."""
        header = self.world.broadcast_object(None, root=self.source)
        return header, _rollouts(header, self.dataset, self.n)

    def move(self, rollouts: Rollouts, wanted: list[list[int]]) -> None:
        """Trainer rank r holds the responses of sequences `wanted[r]` (`StepRollouts.move`; all trainer ranks call)."""
        if self.world.rank == 0:
            counts = torch.tensor([len(rows) for rows in wanted], dtype=torch.int64, device=self.on)
            rows = torch.tensor([i for rows in wanted for i in rows], dtype=torch.int64, device=self.on)
            for tensor in (counts, rows):
                if tensor.numel():  # as `_received` skips an empty one
                    self.world.bridge.send([tensor], self.source, 0).wait()
        mine = wanted[self.world.rank]
        packed = self._received(torch.empty(packed_size(rollouts, mine), dtype=torch.float64))
        unpack_responses(rollouts, mine, packed)

    def _received(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` filled by the next message from the other side's sending rank (trainer rank 0 or the first
        rollout rank), on the CPU."""
        if not tensor.numel():
            return tensor
        landing = tensor.to(self.on)
        self.world.bridge.recv([landing], 0 if self.world.rank == self.source else self.source, 0).wait()
        return landing.cpu()


def batch_payload(rollouts: Rollouts, step: int, indices: list[int], metrics: dict[str, float]) -> dict:
    """A generated batch as plain values (JSON-safe, for checkpoints); responses as the first rollout
    rank holds them; `metrics` of its making. `error`: why no reward call succeeded, if none did."""
    failed = len(rollouts) and rollouts.num_reward_errors + rollouts.num_reward_timeouts == len(rollouts)
    error = None
    if failed:
        error = (f"all {len(rollouts)} reward calls failed ({rollouts.num_reward_errors} errors, "
                 f"{rollouts.num_reward_timeouts} timeouts); first: {rollouts.first_reward_failure}")
    multi_turn = bool(rollouts.loss_masks)
    return {"step": step, "indices": indices, "response_ids": rollouts.response_ids,
            "logprobs": rollouts.rollout_logprobs, "token_versions": rollouts.token_versions,
            "finish_reasons": rollouts.finish_reasons, "scores": rollouts.scores, "score_extras": rollouts.score_extras,
            "num_reward_errors": rollouts.num_reward_errors, "num_reward_timeouts": rollouts.num_reward_timeouts,
            "first_reward_failure": rollouts.first_reward_failure, "error": error, "metrics": metrics,
            "openings": rollouts.openings if multi_turn else None,
            "loss_masks": rollouts.loss_masks, "trajectory_stats": rollouts.trajectory_stats}


def batch_header(payload: dict) -> dict:
    """The payload less its per-token columns, with what the trainer needs of them: each response's length, and the
    ages of its tokens' policy versions (batch `step` trains on version step - 1; a token of version v is
    step - 1 - v old): the oldest's age, the mean age, and the share of responses whose tokens span versions."""
    header = {key: value for key, value in payload.items() if key not in PER_TOKEN}
    ages = [payload["step"] - 1 - version for versions in payload["token_versions"] for version in versions]
    spanning = [len(set(versions)) > 1 for versions in payload["token_versions"]]
    openings = payload["openings"]
    return {**header, "response_lengths": [len(ids) for ids in payload["response_ids"]],
            "opening_lengths": [len(ids) for ids in openings] if openings is not None else None,
            "staleness": max(ages, default=0),
            "staleness_mean": sum(ages) / max(len(ages), 1),
            "multi_version_responses": sum(spanning) / max(len(spanning), 1)}


def _rollouts(header: dict, dataset: PromptDataset, n: int) -> Rollouts:
    """A batch's `Rollouts`, with no response (nor a multi-turn trajectory's opening) held."""
    prompts = [p for i in header["indices"] for p in [dataset[i]] * n]
    num_sequences, multi_turn = len(prompts), header["opening_lengths"] is not None
    return Rollouts(
        prompts=prompts, group_ids=[i // n for i in range(num_sequences)], replicas=[0] * num_sequences,
        response_lengths=header["response_lengths"], response_ids=[None] * num_sequences,
        rollout_logprobs=[None] * num_sequences,
        finish_reasons=header["finish_reasons"], scores=header["scores"], score_extras=header["score_extras"],
        num_reward_errors=header["num_reward_errors"], num_reward_timeouts=header["num_reward_timeouts"],
        first_reward_failure=header["first_reward_failure"],
        loss_masks=[None] * num_sequences if multi_turn else [], openings=[None] * num_sequences if multi_turn else [],
        opening_lengths=header["opening_lengths"] or [],
        trajectory_stats=header["trajectory_stats"])
