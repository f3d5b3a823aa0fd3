"""Every random stream of a run, derived from the run's seed by one function: `derive_seed`.

Policy (DESIGN.md, "Policies with one home"): a stream is named by the run's seed, a purpose (a
fixed string per kind of draw) and integer coordinates: the RL step, an engine replica (no stream
splits over replicas today: a rollout's requests are seeded by their prompt's position in the step,
so generations do not depend on the number of replicas), and the draw within that step (a DAPO
filter round, a PPO epoch, a data epoch). Its seed is the BLAKE2b
hash of that tuple cut to 62 bits, so distinct tuples give unrelated seeds and never collide in
practice, however large the coordinates grow (unlike `seed * a + step * b` formulas, which collide
once a coordinate passes a multiplier). 62 bits leave room for the per-request offsets of a
rollout call (`Sampling.seed + i`) inside a signed 64-bit generator seed.

The streams (purpose: coordinates):
    "prompt_order":     draw=data epoch; the shuffled order of the training prompts
    "rollout":          step, draw=filter round; training generations (one engine call)
    "validation":       none; validation generations, the same at every validation (and in generate.py)
    "mini_batch_order": step, draw=PPO epoch; the order of groups in an update's mini-batches
    "multi_turn":       seed=the rollout call's seed, draw=turn; turn t of a multi-turn rollout, whose
                        trajectory i samples with this seed + i (`megarl.agent.trajectories`)
Model initialisation is seeded by megatron-core from the run's seed (`init_layout`).
"""

from __future__ import annotations

import hashlib

SEED_BITS = 62


def derive_seed(seed: int, purpose: str, *, step: int = 0, replica: int = 0, draw: int = 0) -> int:
    """The seed of the stream named by (seed, purpose, step, replica, draw): an int in [0, 2**62)."""
    key = repr((int(seed), str(purpose), int(step), int(replica), int(draw))).encode()  # unambiguous
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)
