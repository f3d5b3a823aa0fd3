"""PRIME's implicit process reward model in the RL step (the math: `megarl.algorithms.prime`).

    prm = ImplicitPRM(config.prime, engine, reference)
    history = prm.process_rewards(batch, group_ids_B, num_groups, function_scores_B, seed, step, stats)
    # batch.response_tensors.process_rewards_BR: beta * log(pi_prm / pi_ref) per response token

The PRM is a trainable Megatron engine on the actor's layout, trained like the critic: `engine.update`
with mini-batches of whole groups, here with the cross-entropy of its implicit sequence reward against
the reward function's labels (score > `correct_threshold`). Its frozen reference scores every step's
batch once, for both the update and the rewards. With `update=before` (the paper's order) the PRM trains
on the step's responses and then scores them; with `update=after` it scores them first, which a
single-step update gives for free (the outputs of its own forward before the step).

Logged: `prime/prm_loss` and `prime/prm_accuracy` (mean over the update's optimizer steps; the accuracy
of each step's forward before it trains on its mini-batch: responses the PRM has not seen when
`prime.ppo_epochs=1`), `prime/reward_accuracy` (the accuracy of the rewards the advantages use) and the
token and sequence rewards' statistics.
"""

from __future__ import annotations

import torch

from megarl.algorithms import implicit_accuracy, implicit_token_rewards
from megarl.config.schema import PrimeConfig
from megarl.engine.batch import SequenceBatch
from megarl.engine.megatron_engine import MegatronEngine
from megarl.trainer.losses import prm_loss
from megarl.trainer.metrics import ShareStats


class ImplicitPRM:
    def __init__(self, config: PrimeConfig, engine: MegatronEngine, reference: MegatronEngine):
        """`engine`: the trainable PRM; `reference`: its frozen start (possibly the run's reference model)."""
        self.config, self.engine, self.reference = config, engine, reference
        self.loss = prm_loss(config)

    def process_rewards(self, batch: SequenceBatch, group_ids_B: torch.Tensor, num_groups: int,
                        function_scores_B: torch.Tensor, seed: int, step: int, stats: ShareStats
                        ) -> list[dict[str, float]]:
        """Train the PRM on this DP rank's share (whole groups, `engine.update`'s arguments) and put its
        token rewards into `batch.response_tensors.process_rewards_BR`. Returns the update's metrics."""
        tensors, mask_BR = batch.response_tensors, batch.response_mask_BR
        # The PRM is a model of its own: scored at temperature 1, whatever the rollout's temperature.
        tensors.prm_ref_logprobs_BR = self.reference.score(batch)["logprobs"]
        labels_B = (function_scores_B > self.config.correct_threshold).float()
        tensors.prm_labels_BR = labels_B[:, None] * mask_BR
        if self.config.update == "before":
            history, _ = self.engine.update(batch, group_ids_B, num_groups, self.loss, seed, step)
            prm_logprobs_BR = self.engine.score(batch)["logprobs"]
        else:
            single_forward = self.engine.is_single_step(num_groups)
            scored = None if single_forward else self.engine.score(batch)
            history, kept = self.engine.update(batch, group_ids_B, num_groups, self.loss, seed, step,
                                               keep_outputs=single_forward)
            prm_logprobs_BR = (kept if single_forward else scored)["logprobs"]
        rewards_BR = implicit_token_rewards(prm_logprobs_BR, tensors.prm_ref_logprobs_BR, mask_BR, self.config.beta)
        tensors.process_rewards_BR = rewards_BR
        sequence_rewards_B = rewards_BR.sum(dim=-1)
        stats.add_mean("prime/reward_accuracy", implicit_accuracy(sequence_rewards_B, labels_B))
        stats.add_mean("prime/token_reward/mean", rewards_BR[mask_BR > 0])
        stats.add_range("prime/token_reward", rewards_BR[mask_BR > 0])
        stats.add_mean("prime/sequence_reward/mean", sequence_rewards_B)
        return history
