"""Asynchronous split placement at scale, on paper: step time and speed-up over colocated synchronous RL.

    python bench/async_cost_model.py

GRPO/DAPO on Qwen2.5-7B with long-tailed responses, as verl measured its fully asynchronous trainer
(Qwen2.5-Math-7B, same architecture, on 32, 64 and 128 H20 GPUs), and on 64 H100s. Every number the
model uses is a named constant below with its source, or marked ASSUMPTION.

Phases, each priced from first principles:
- Generation: one vLLM engine per `ENGINE_TP` GPUs decodes its share of the batch with continuous
  batching. A decode iteration of `b` sequences holding `C` tokens of context costs
  max(memory, compute) + a fixed per-iteration overhead, where memory = (weights + C x KV bytes per
  token) / HBM bandwidth and compute = (2 x matmul parameters x b + attention FLOPs over C) / peak
  FLOPs; `b` is capped by vLLM's max_num_seqs and the KV cache's capacity. The response lengths are
  the quantiles of a clipped log-normal (deterministic: no sampling), dealt to the engines round
  robin from the longest; the engine holding the longest response decides the phase's time, so a
  long tail costs its length times the latency of a small-batch iteration.
- Training: 6 x matmul parameters per token plus causal attention, at an MFU; before it the trainer
  recomputes the old log-probs (a forward pass), as verl's colocated baseline and megarl do whenever the
  update takes several optimizer steps (ASSUMPTION: DAPO's do), unless the engine's log-probs serve
  (`actor.recompute_old_logprobs=false`; verl's fully asynchronous trainer): [logprob] below.
- Weight sync: colocated, the weights over NVLink plus the engine's wake-up and sleep; split, a
  pipelined broadcast of the weights from the trainer over one GPU's network link plus the engines'
  weight loading.

Schedules, per step of the same samples on the same G GPUs (steady state), as megarl runs them
(`megarl.placement.split`):
- colocated synchronous:            gen(G) + [logprob(G)] + train(G) + sync_colocated
- split, staleness 0:               gen(G_r) + [logprob(G_t)] + train(G_t) + sync_split
- split, staleness k >= 1:          max(gen(G_r), [logprob(G_t)] + train(G_t)) + sync_split
  (a whole batch generated while the trainer trains on an earlier one; k bounds how far ahead)
- split, staleness k, partial:      max(rollout(G_r), [logprob(G_t)] + train(G_t)) + sync_split
  where rollout() simulates megarl's partial rollouts response by response (`simulate_partial_rollouts`):
  a step's batch is the first groups to finish, the engine stays full, and the price of carrying the
  tail across steps is paid where megarl pays it: each response continuing after a sync recomputes its
  KV cache (unless `rollout.keep_kv`), and a step waits for a group at the last step the bound allows it.
For each, the best split of G into rollout and trainer GPUs (whole nodes) and verl's even split.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field, replace
from statistics import NormalDist

BF16 = 2
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_flops: float
    """Dense BF16 tensor-core peak, FLOP/s."""
    hbm_bytes_per_s: float
    memory_bytes: float
    nvlink_bytes_per_s: float
    """Per GPU, one direction."""
    network_bytes_per_s: float
    """One GPU's network link (one NIC per GPU), one direction."""


# NVIDIA H100 SXM datasheet: 989 TFLOPS dense BF16 (1,979 with sparsity), 3.35 TB/s HBM3, 80 GB,
# NVLink 900 GB/s bidirectional; DGX H100: 8 x 400 Gb/s ConnectX-7, one per GPU.
H100 = Gpu("H100 SXM", 989e12, 3.35e12, 80e9, 450e9, 400e9 / 8)
# H20 (the GPU of verl's measurements): 148 TFLOPS dense BF16, 4.0 TB/s HBM3, 96 GB, NVLink 900 GB/s,
# as reported in the press at its launch (NVIDIA publishes no datasheet). ASSUMPTION: 400 Gb/s per
# GPU of network, as a DGX H100 (verl does not say).
H20 = Gpu("H20", 148e12, 4.0e12, 96e9, 450e9, 400e9 / 8)


@dataclass(frozen=True)
class Model:
    """The fields of a dense decoder's HF config that its costs depend on."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (all but the input embedding)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q + 2 * kv + q * h  # Q, K, V with biases (Qwen2), O
        mlp = 3 * h * self.ffn_hidden_size
        return self.num_layers * (attention + mlp + 2 * h) + h + self.vocab_size * h  # + norms, LM head

    @property
    def weight_bytes(self) -> float:
        return BF16 * (self.matmul_params + self.vocab_size * self.hidden_size)

    @property
    def kv_bytes_per_token(self) -> float:
        return BF16 * 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def attention_flops(self, context_tokens: float) -> float:
        """Forward FLOPs of one token's attention scores and weighted sum over `context_tokens`."""
        return 4 * self.num_layers * self.num_heads * self.head_dim * context_tokens


# huggingface.co/Qwen/Qwen2.5-7B/config.json (Qwen2.5-Math-7B has the same shapes): 7.62B parameters.
QWEN25_7B = Model("Qwen2.5-7B", hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                  ffn_hidden_size=18944, vocab_size=152064)


@dataclass(frozen=True)
class ResponseLengths:
    """Log-normal response lengths clipped at the maximum: most responses short, a long tail."""

    median: float
    sigma: float
    """Of the log; 0: every response `median` tokens."""
    max_length: int

    def quantiles(self, count: int) -> list[int]:
        """`count` lengths at the quantiles (i + 0.5) / count, longest first."""
        normal = NormalDist()
        lengths = [min(self.max_length, max(1, round(self.median * math.exp(self.sigma * normal.inv_cdf(
            (i + 0.5) / count))))) for i in range(count)]
        return sorted(lengths, reverse=True)

    def mean(self, count: int = 4096) -> float:
        return sum(self.quantiles(count)) / count

    def draw(self, rng: random.Random) -> int:
        """One length at random (the partial rollouts' simulation draws its responses one by one)."""
        length = self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        return min(self.max_length, max(1, round(length)))


@dataclass(frozen=True)
class Workload:
    prompts: int
    samples: int
    """Responses per prompt."""
    prompt_length: int
    responses: ResponseLengths

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples


# verl's 7B fully-async experiment (verl docs, advance/fully_async.md, "Asynchronous Training on 7B
# Model"): DAPO, 512 prompts x 16 responses per step (train_batch_size 512, rollout.n 16),
# max_response_length 28K tokens.
# ASSUMPTION: prompts of 256 tokens; responses log-normal with median 1,200 tokens and sigma 1.0
# (mean ~2,000 tokens, 1% longer than 12,300, 0.1% clipped at 28K). verl publishes no length
# distribution; this mean is what its colocated update_actor time (113.81 s on 128 H20) implies at
# the training MFU below, and the tail is what makes its generation phase (177.85 s) as long as it is.
DAPO_7B = Workload(prompts=512, samples=16, prompt_length=256,
                   responses=ResponseLengths(median=1200, sigma=1.0, max_length=28 * 1024))


@dataclass(frozen=True)
class Efficiency:
    """How close each phase gets to the hardware, and its fixed costs. All ASSUMPTIONS, typical of
    current engines, except where a source is named."""

    decode_flops: float = 0.5
    """Fraction of peak FLOPs a large-batch decode iteration reaches (bandwidth-bound below that)."""
    hbm: float = 0.8
    """Fraction of HBM bandwidth a decode iteration's weight and KV reads reach."""
    iteration_overhead_s: float = 0.002
    """Per decode iteration: scheduling, sampling, launches (vLLM with CUDA graphs)."""
    prefill_mfu: float = 0.4
    train_mfu: float = 0.35
    """Split trainer, and colocated trainer unless `colocated_train_mfu` says otherwise."""
    colocated_train_mfu: float | None = None
    """None: `train_mfu`. verl's own tables show its colocated trainer at about half the split
    trainer's throughput per GPU (update_actor 113.81 s on 128 GPUs colocated, 113.16 s on 64 split)."""
    max_num_seqs: int = 1024
    """vLLM's default for GPUs of >= 70 GB (vllm/engine/arg_utils.py, _set_default_max_num_seqs...)."""
    gpu_memory_utilization: float = 0.92
    """vLLM's default (vllm/config/cache.py)."""
    link: float = 0.8
    """Fraction of a link's bandwidth a weight transfer reaches."""
    colocated_switch_s: float = 5.0
    """Per colocated step: waking the engine (re-allocating its KV cache), then putting it to sleep.
    verl's colocated 128-GPU row leaves 10.7 s of its step outside gen, old_log_prob and update_actor."""
    engine_load_s: float = 1.0
    """Per split sync: the engines loading the received weights into their parameters."""


@dataclass(frozen=True)
class Cluster:
    gpu: Gpu
    num_gpus: int
    engine_tp: int = 1
    """ASSUMPTION: a 7B model's engine on one GPU (15 GB of weights leave ~70 GB of KV cache)."""


@dataclass(frozen=True)
class Pricing:
    """Everything one phase's price depends on."""

    model: Model
    workload: Workload
    cluster: Cluster
    efficiency: Efficiency

    def decode_iteration_seconds(self, batch: int, context_tokens: float) -> float:
        """One engine's decode iteration of `batch` sequences holding `context_tokens` of KV cache."""
        m, gpu, e, tp = self.model, self.cluster.gpu, self.efficiency, self.cluster.engine_tp
        memory = (m.weight_bytes + context_tokens * m.kv_bytes_per_token) / (tp * gpu.hbm_bytes_per_s * e.hbm)
        flops = 2 * m.matmul_params * batch + m.attention_flops(context_tokens)
        return max(memory, flops / (tp * gpu.bf16_flops * e.decode_flops)) + e.iteration_overhead_s

    def max_concurrent(self) -> int:
        """Sequences an engine runs at once: vLLM's max_num_seqs, or fewer where the KV cache of
        sequences of mean length does not fit."""
        m, gpu, e, w = self.model, self.cluster.gpu, self.efficiency, self.workload
        cache = self.cluster.engine_tp * gpu.memory_bytes * e.gpu_memory_utilization - m.weight_bytes
        per_sequence = (w.prompt_length + w.responses.mean()) * m.kv_bytes_per_token
        return max(1, min(e.max_num_seqs, int(cache // per_sequence)))

    def prefill_seconds(self, contexts: list[int]) -> float:
        """One engine filling the KV cache of sequences of `contexts` tokens (causal attention)."""
        m, e, tp = self.model, self.efficiency, self.cluster.engine_tp
        flops = sum(2 * m.matmul_params * c + m.attention_flops(c / 2) * c for c in contexts)
        return flops / (tp * self.cluster.gpu.bf16_flops * e.prefill_mfu)

    def decode_seconds(self, batch: int, starts: int, begin: int, end: int) -> float:
        """Decode iterations `begin` to `end` of one engine whose `batch` sequences stay the same: a sequence that
        would have had no token at iteration a holds the prompt and x - a tokens at iteration x (`starts`: the
        sum of their a), so the context grows by one token per sequence and iteration (priced at its midpoint)."""
        context = batch * (self.workload.prompt_length + (begin + end) / 2) - starts
        return (end - begin) * self.decode_iteration_seconds(batch, context)

    def engine_generation_seconds(self, lengths: list[int]) -> float:
        """One engine generating responses of `lengths` (admission order) with continuous batching:
        prefill, then decode (`decode_seconds` between two completions)."""
        w = self.workload
        seconds = self.prefill_seconds([w.prompt_length] * len(lengths))
        waiting, limit = deque(lengths), self.max_concurrent()
        running: list[tuple[int, int]] = []  # heap of (iteration it finishes, iteration it was admitted)
        iteration, admitted_sum = 0, 0
        while waiting or running:
            while waiting and len(running) < limit:
                heapq.heappush(running, (iteration + waiting.popleft(), iteration))
                admitted_sum += iteration
            end = running[0][0]
            seconds += self.decode_seconds(len(running), admitted_sum, iteration, end)
            iteration = end
            while running and running[0][0] == iteration:
                admitted_sum -= heapq.heappop(running)[1]
        return seconds

    @functools.lru_cache(maxsize=None)
    def generation_seconds(self, num_gpus: int) -> float:
        """A step's responses generated whole on `num_gpus` GPUs: the engine dealt the longest ones decides."""
        engines = num_gpus // self.cluster.engine_tp
        lengths = self.workload.responses.quantiles(self.workload.sequences)
        return self.engine_generation_seconds(lengths[::engines])

    @functools.lru_cache(maxsize=None)
    def partial_rollouts(self, num_gpus: int, staleness: int, keep_kv: bool) -> PartialSteps:
        return simulate_partial_rollouts(self, num_gpus, staleness, keep_kv)

    def forward_flops(self) -> float:
        """One forward pass over one step's sequences (prompt + response), causal attention."""
        m, prompt = self.model, self.workload.prompt_length
        return sum((prompt + n) * (2 * m.matmul_params + m.attention_flops((prompt + n) / 2))
                   for n in self.workload.responses.quantiles(self.workload.sequences))

    def train_seconds(self, num_gpus: int, colocated: bool) -> float:
        e = self.efficiency
        mfu = (e.colocated_train_mfu or e.train_mfu) if colocated else e.train_mfu
        return 3 * self.forward_flops() / (num_gpus * self.cluster.gpu.bf16_flops * mfu)

    def logprob_seconds(self, num_gpus: int, colocated: bool) -> float:
        return self.train_seconds(num_gpus, colocated) / 3

    def colocated_sync_seconds(self) -> float:
        gpu, e = self.cluster.gpu, self.efficiency
        return self.model.weight_bytes / (gpu.nvlink_bytes_per_s * e.link) + e.colocated_switch_s

    def split_sync_seconds(self) -> float:
        """A pipelined broadcast (tree or chain) delivers the weights to every engine in about the
        time one link takes to carry them once."""
        gpu, e = self.cluster.gpu, self.efficiency
        return self.model.weight_bytes / (gpu.network_bytes_per_s * e.link) + e.engine_load_s


@dataclass(eq=False)
class _Response:
    length: int
    """Its tokens once it ends."""
    group: _Group
    generated: int = 0
    """Tokens so far, as of the last pause."""


@dataclass(eq=False)
class _Group:
    unfinished: int
    last_batch: int
    """The last batch that may train on it: admitted on version v, batch v + 1 + staleness."""
    responses: list[_Response] = field(default_factory=list)


@dataclass(frozen=True)
class PartialSteps:
    """Partial rollouts' steady state on one engine (`simulate_partial_rollouts`)."""

    seconds: float
    """Engine seconds per step, KV recomputation included (the rollout ranks wait out the rest of the step)."""
    recompute_seconds: float
    """Of which: re-filling the KV cache of the responses that continue after a sync."""
    trained_length: float
    """Mean length of the responses trained on (every group admitted is trained: the workload's mean)."""


def simulate_partial_rollouts(pricing: Pricing, num_gpus: int, staleness: int, keep_kv: bool,
                              steps: int = 24, warmup: int = 8, seed: int = 0) -> PartialSteps:
    """megarl's partial rollouts (`megarl.generation.partial`) on one of `num_gpus / engine_tp` identical engines,
    response by response: `rollout.partial_groups` groups in flight (its default: a step's prompts, dealt over
    the engines); a finished group's place goes to a new prompt at once; batch j is filled while the trainer
    trains on batch j - 1, with the weights of version j - 2; then the engine waits for the sync to version
    j - 1, which pauses every request. A group admitted on version v must be trained by batch v + 1 + staleness:
    a prompt is admitted only if batches of the engine's share, the earliest last batches first, can still take
    every group admitted in time, and batch j is the finished groups of the earliest last batches once those
    left can still be taken in time. Unless `keep_kv` (the requests staying in the engine through the sync, KV
    cache and all: `rollout.keep_kv`), every response that continues after a sync first recomputes the KV cache
    of its prompt and tokens so far. Response lengths are drawn from the workload's distribution with `seed`;
    the first `warmup` steps are left out."""
    w = pricing.workload
    engines = num_gpus // pricing.cluster.engine_tp
    share, limit, rng = w.prompts / engines, pricing.max_concurrent(), random.Random(seed)
    groups_in_flight = max(1, round(share))
    in_flight: list[_Group] = []
    finished: list[_Group] = []
    pending: deque[_Response] = deque()
    """Responses to (re)submit, in order: those that continue after a pause, then new groups'."""
    running: list[tuple[int, int, int, _Response]] = []
    """Heap of (the iteration it ends, the iteration it would have started at with no tokens, its order of
    submission, response)."""
    submitted = itertools.count()
    iteration = offsets = taken = 0
    seconds = recompute = trained_tokens = trained_responses = 0.0

    def late(groups: list[_Group], taken: int) -> bool:
        """Whether batches from the one after `taken` groups on, the earliest last batches first, would take one
        of `groups` after its last batch (the engine's share of batches 1 .. b: round(b * share) groups)."""
        order = sorted(group.last_batch for group in groups)
        return any(taken + i >= round(last * share) for i, last in enumerate(order))

    def ready(wanted: int) -> list[_Group] | None:
        if len(finished) < wanted:
            return None
        batch = sorted(finished, key=lambda group: group.last_batch)[:wanted]
        left = [group for group in [*finished, *in_flight] if group not in batch]
        return None if late(left, taken + wanted) else batch

    for batch in range(1, warmup + steps + 1):
        version = max(0, batch - 2)
        if batch == warmup + 1:
            seconds = recompute = trained_tokens = trained_responses = 0.0
        if batch > 2 and not keep_kv:  # a sync (to version batch - 2) paused what continues now
            cost = pricing.prefill_seconds([w.prompt_length + r.generated for r in pending if r.generated])
            seconds, recompute = seconds + cost, recompute + cost
        wanted = round(batch * share) - taken
        while (trained := ready(wanted)) is None:
            admitted = []
            while len(in_flight) < groups_in_flight:
                group = _Group(w.samples, version + 1 + staleness)
                if late([*finished, *in_flight, group], taken):
                    break
                group.responses = [_Response(w.responses.draw(rng), group) for _ in range(w.samples)]
                in_flight.append(group)
                admitted += group.responses
            pending += admitted
            seconds += pricing.prefill_seconds([w.prompt_length] * len(admitted))
            while pending and len(running) < limit:
                response = pending.popleft()
                start = iteration - response.generated
                heapq.heappush(running, (start + response.length, start, next(submitted), response))
                offsets += start
            end = running[0][0]
            seconds += pricing.decode_seconds(len(running), offsets, iteration, end)
            iteration = end
            while running and running[0][0] == iteration:
                _, start, _, response = heapq.heappop(running)
                offsets -= start
                response.generated = response.length
                response.group.unfinished -= 1
                if not response.group.unfinished:
                    in_flight.remove(response.group)
                    finished.append(response.group)
        for group in trained:
            finished.remove(group)
            trained_tokens += sum(r.length for r in group.responses)
            trained_responses += len(group.responses)
        taken += wanted
        # the pause before the next sync: every running request leaves the engine, first in line to continue
        paused = sorted(running, key=lambda entry: entry[2])
        for _, start, _, response in paused:
            response.generated = iteration - start
        pending.extendleft(response for *_, response in reversed(paused))
        running, offsets = [], 0
    return PartialSteps(seconds / steps, recompute / steps, trained_tokens / trained_responses)


@dataclass(frozen=True)
class Schedule:
    name: str
    staleness: int | None
    """None: colocated synchronous."""
    partial: bool = False
    recompute_old_logprobs: bool = True
    """False: the engine's log-probs are the old ones, and the trainer skips its scoring pass."""
    keep_kv: bool = False
    """Partial rollouts whose requests stay in the engine through a sync, KV cache and all (`rollout.keep_kv`; it
    still re-prefills them after a checkpoint and before a validation, which this model leaves out)."""


SCHEDULES = [Schedule("colocated synchronous", None),
             Schedule("colocated synchronous, engine's log-probs", None, recompute_old_logprobs=False),
             Schedule("split, staleness 0", 0),
             Schedule("split, staleness 1 (one-step off-policy)", 1),
             Schedule("split, staleness 1, partial rollouts", 1, partial=True),
             Schedule("split, staleness 2, partial rollouts", 2, partial=True),
             Schedule("split, staleness 2, partial, engine's log-probs", 2, partial=True,
                      recompute_old_logprobs=False),
             Schedule("split, staleness 2, partial, engine's log-probs, KV kept", 2, partial=True,
                      recompute_old_logprobs=False, keep_kv=True)]


@dataclass(frozen=True)
class Step:
    seconds: float
    rollout_busy: float
    """Seconds per step the rollout GPUs compute (generation; colocated: all of the step's phases)."""
    trainer_busy: float
    partial: PartialSteps | None = None


def step(pricing: Pricing, schedule: Schedule, rollout_gpus: int) -> Step:
    """One steady-state step of `schedule`, split placement with `rollout_gpus` of the cluster's GPUs."""
    colocated = schedule.staleness is None
    trainer_gpus = pricing.cluster.num_gpus if colocated else pricing.cluster.num_gpus - rollout_gpus
    train = pricing.train_seconds(trainer_gpus, colocated)
    if schedule.recompute_old_logprobs:
        train += pricing.logprob_seconds(trainer_gpus, colocated)
    if colocated:
        busy = pricing.generation_seconds(trainer_gpus) + train + pricing.colocated_sync_seconds()
        return Step(busy, busy, busy)
    sync = pricing.split_sync_seconds()
    if schedule.partial:
        partial = pricing.partial_rollouts(rollout_gpus, schedule.staleness, schedule.keep_kv)
        return Step(max(partial.seconds, train) + sync, partial.seconds, train, partial)
    generate = pricing.generation_seconds(rollout_gpus)
    if schedule.staleness == 0:
        return Step(generate + train + sync, generate, train)
    return Step(max(generate, train) + sync, generate, train)


def rollout_splits(num_gpus: int) -> list[int]:
    """Rollout GPUs in whole nodes, leaving the trainer at least one node."""
    return list(range(GPUS_PER_NODE, num_gpus - GPUS_PER_NODE + 1, GPUS_PER_NODE))


def best_split(pricing: Pricing, schedule: Schedule) -> tuple[int, Step]:
    return min(((g, step(pricing, schedule, g)) for g in rollout_splits(pricing.cluster.num_gpus)),
               key=lambda pair: pair[1].seconds)


@dataclass(frozen=True)
class Published:
    """One row pair of verl's table: colocated sync against fully_async_policy on the same GPUs."""

    num_gpus: int
    split: str
    colocated: dict[str, float]
    """Mean seconds per step: step, gen, old_log_prob, update_actor."""
    fully_async: dict[str, float]
    """Mean seconds per step: step, gen (the trainer waiting for samples), update_actor."""
    speedup: str
    """Of the total time to 100 / 200 / 300 / 400 steps."""


# verl docs, advance/fully_async.md, "Asynchronous Training on 7B Model": Qwen2.5-Math-7B on H20,
# DAPO, colocated sync against fully_async_policy (staleness_threshold 0.5, partial rollouts,
# require_batches 4, trigger_parameter_sync_step 4).
VERL_FULLY_ASYNC = {
    32: Published(32, "16:16", dict(step=790.10, gen=357.41, old_log_prob=107.71, update_actor=313.81),
                  dict(step=294.77, gen=21.26, update_actor=269.80), "1.72x / 1.70x / 2.31x / 2.66x"),
    64: Published(64, "32:32", dict(step=365.28, gen=150.72, old_log_prob=70.26, update_actor=133.41),
                  dict(step=189.26, gen=28.46, update_actor=156.98), "2.09x / 2.03x / 1.83x / 1.92x"),
    128: Published(128, "64:64", dict(step=356.30, gen=177.85, old_log_prob=53.92, update_actor=113.81),
                   dict(step=150.63, gen=33.14, update_actor=113.16), "2.67x / 2.65x / 2.67x / 2.35x"),
}
# AReaL (Fu et al., arXiv 2505.24298): up to 2.77x over synchronous systems on the same GPUs; its docs
# (inclusionai.github.io/AReaL/algorithms/async.html): synchronous is "typically 2x slower".
AREAL_SPEEDUP = 2.77


def report(pricing: Pricing, published: Published | None) -> None:
    c, w, e = pricing.cluster, pricing.workload, pricing.efficiency
    print(f"\n{pricing.model.name} on {c.num_gpus} {c.gpu.name}, engines at TP{c.engine_tp} "
          f"(<= {pricing.max_concurrent()} sequences each); {w.prompts} prompts x {w.samples} responses; training "
          f"MFU {e.train_mfu:g} split, {e.colocated_train_mfu or e.train_mfu:g} colocated")
    n = c.num_gpus
    print(f"  colocated phases, s: gen {pricing.generation_seconds(n):.1f} "
          f"({without_tail(pricing).generation_seconds(n):.1f} were every response of the mean length), "
          f"old_log_prob {pricing.logprob_seconds(n, True):.1f}, update_actor {pricing.train_seconds(n, True):.1f}, "
          f"sync {pricing.colocated_sync_seconds():.1f}; split sync {pricing.split_sync_seconds():.1f}")
    if published:
        print("  verl measured, s: colocated " + ", ".join(f"{k} {v}" for k, v in published.colocated.items())
              + f"; fully async at {published.split}: "
              + ", ".join(f"{k} {v}" for k, v in published.fully_async.items()))
    baseline, even, rows = step(pricing, SCHEDULES[0], 0).seconds, n // 2, []
    for schedule in SCHEDULES:
        if schedule.staleness is None:
            seconds = step(pricing, schedule, 0).seconds
            rows.append([schedule.name, "-", f"{seconds:.1f}", f"{baseline / seconds:.2f}", "", "", "", "", ""])
            continue
        at_even = step(pricing, schedule, even)
        best_rollout, best = best_split(pricing, schedule)
        partial = best.partial
        rows.append([schedule.name, f"{best_rollout}:{n - best_rollout}", f"{best.seconds:.1f}",
                     f"{baseline / best.seconds:.2f}", f"{best.rollout_busy:.0f} / {best.trainer_busy:.0f}",
                     f"{partial.recompute_seconds:.0f} / {partial.trained_length:.0f}"
                     if partial else "", f"{at_even.seconds:.1f}", f"{baseline / at_even.seconds:.2f}",
                     f"{at_even.rollout_busy:.0f} / {at_even.trainer_busy:.0f}"])
    print_table(["schedule", "best rollout:trainer", "step s", "speed-up", "busy s (gen / train)",
                 "KV recompute s / length", f"step s at {even}:{even}", "speed-up",
                 "busy s (gen / train)"], rows)
    if published:
        ratio = published.colocated["step"] / published.fully_async["step"]
        print(f"  published: verl fully_async_policy at {published.split} (staleness_threshold 0.5, partial rollouts): "
              f"{ratio:.2f}x per step; {published.speedup} in total time to 100 / 200 / 300 / 400 steps")


def decode_throughput(pricing: Pricing, batches: list[int]) -> str:
    """Tokens per second per GPU of a decode iteration at each batch size, context at the mean length."""
    w, tp = pricing.workload, pricing.cluster.engine_tp
    context = w.prompt_length + w.responses.mean()
    return ", ".join(f"{b}: {b / pricing.decode_iteration_seconds(b, b * context) / tp:,.0f}" for b in batches)


def without_tail(pricing: Pricing) -> Pricing:
    """The same, every response of the mean length: what generation costs without its tail."""
    responses = pricing.workload.responses
    flat = ResponseLengths(round(responses.mean()), 0.0, responses.max_length)
    return replace(pricing, workload=replace(pricing.workload, responses=flat))


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def main() -> None:
    print("Asynchronous split placement against colocated synchronous training, on paper "
          "(bench/async_cost_model.py; every input named there with its source or marked ASSUMPTION)")
    r = DAPO_7B.responses
    print(f"{QWEN25_7B.name} ({QWEN25_7B.weight_bytes / BF16 / 1e9:.2f}B "
          f"parameters, {QWEN25_7B.kv_bytes_per_token / 1024:.0f} KiB of KV cache per token), DAPO "
          f"{DAPO_7B.prompts} prompts x {DAPO_7B.samples} responses per step, "
          f"prompts of {DAPO_7B.prompt_length} tokens, "
          f"responses log-normal median {r.median:.0f} sigma {r.sigma:g} clipped at {r.max_length} (mean "
          f"{r.mean():.0f}; the longest of a step's {DAPO_7B.sequences}: {r.quantiles(DAPO_7B.sequences)[0]})")
    print("speed-up: colocated step / split step, same GPUs and samples per step; busy: seconds per step each side "
          "computes (the rest of its step it waits)")
    assumed = Efficiency()
    for gpu in (H20, H100):
        pricing = Pricing(QWEN25_7B, DAPO_7B, Cluster(gpu, 64), assumed)
        print(f"decode tokens/s per {gpu.name} by batch size: " + decode_throughput(pricing, [1, 16, 64, 256, 1024]))
    for num_gpus in (64, 128):
        report(Pricing(QWEN25_7B, DAPO_7B, Cluster(H20, num_gpus), assumed), VERL_FULLY_ASYNC[num_gpus])
    print("\nThe same with the colocated trainer at half the split trainer's MFU, as verl's own update_actor "
          "times show (113.81 s on 128 colocated GPUs, 113.16 s on 64 split ones):")
    report(Pricing(QWEN25_7B, DAPO_7B, Cluster(H20, 128), replace(assumed, colocated_train_mfu=assumed.train_mfu / 2)),
           VERL_FULLY_ASYNC[128])
    print("\nIssue 16's example: the same task on 64 H100s:")
    report(Pricing(QWEN25_7B, DAPO_7B, Cluster(H100, 64), assumed), None)
    print(f"\nAReaL reports up to {AREAL_SPEEDUP}x over synchronous systems on the same GPUs (arXiv 2505.24298).")


if __name__ == "__main__":
    main()
