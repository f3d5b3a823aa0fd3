"""Checkpoints that never lose work.

A crash is a SIGKILL of every process of the job: torchrun's agent, its workers (which torch elastic
starts in sessions of their own, out of reach of `killpg`) and their checkpoint writers. Jobs are
killed at chosen moments (during a rollout, an actor update, a save, an asynchronous save; the
trainer logs the start of each phase at debug level); the kill during the rollout is of the agent
alone, whose workers must die with it. Then `resume_mode=auto` continues from the
newest complete checkpoint. The resumed job must train exactly the steps after that checkpoint and
log every metric bitwise equal to an uninterrupted run (CPU: the same kernels on the same bytes),
for GRPO at DP2, for PPO with a critic at TP2 and for GRPO with LoRA adapters on a Qwen3-MoE's attention and routed
experts at EP2 (its checkpoints hold the adapters alone; the base is re-read from model.path), and its Adam state
must count one step per optimizer step taken. Checkpoints are layout-independent (DP2 -> PP2, TP2 -> DP2).

Split placement at staleness 1 (one trainer rank, one rollout rank, `hf` engine) checkpoints the batch the
rollout rank generated ahead: killed twice while that batch is queued, the resumed job trains every
step on exactly the uninterrupted run's prompts, none lost or repeated, and no sample it trains on is
more than one policy version old. It trains in bf16, whose fp32 norm weights (megatron's torch norm)
beside bf16 parameters once made the distributed optimizer save each one's Adam state under another's name.
With partial rollouts of multi-turn trajectories (vLLM engine, staleness 2, requests kept in the engine
through the syncs that follow no checkpoint) the checkpoints resumed hold trajectories half generated, whose
environments the resumed job replays and which it finishes on the next weights exactly as the uninterrupted
run did.
"""

from __future__ import annotations

import io
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from megarl.data.synthetic import make_arithmetic
from tests.conftest import ROOT
from tests.integration import user_environment
from tests.integration.job_launch import Launch

TOTAL_STEPS = 4
TRAIN_BATCH_SIZE, MINI_BATCH_SIZE = 4, 2  # prompts: two optimizer steps per RL step, for actor and critic
WALL_CLOCK = ("timing/", "throughput/", "sync/seconds")  # metrics that measure time, not training


@dataclass(frozen=True)
class Job:
    config: str
    experiment: str
    overrides: tuple[str, ...]
    engines: tuple[str, ...]
    async_save: bool
    model: str = "qwen2-tied"
    save_freq: int = 1


JOBS = {
    "grpo_dp2": Job("configs/quickstart.yaml", "quickstart_grpo", (), ("actor",), async_save=False),
    "ppo_tp2": Job("configs/quickstart_ppo.yaml", "quickstart_ppo",
                   ("actor.tp=2", f"critic.ppo_mini_batch_size={MINI_BATCH_SIZE}"), ("actor", "critic"),
                   async_save=True),
    "grpo_split": Job("configs/quickstart.yaml", "quickstart_grpo",
                      ("trainer.placement=split", "rollout.num_ranks=1", "trainer.max_staleness=1",
                       "rollout.backend=hf", "model.dtype=bfloat16"), ("actor",),
                      async_save=False),
    # Partial rollouts of multi-turn trajectories (1 to 3 turns of at most 8 tokens: the environment ends one after
    # a turn of odd length; turns of varied lengths: most would run to 8 tokens on the other models) continue
    # across weight updates; saved every other step, so the sync before step 4 (none saved at 3) keeps the
    # requests in the engine, and the one before step 3 takes them out.
    "grpo_split_partial": Job("configs/quickstart.yaml", "quickstart_grpo",
                              ("trainer.placement=split", "rollout.num_ranks=1", "trainer.max_staleness=2",
                               "rollout.partial=true", "rollout.partial_groups=10", "rollout.n=2",
                               "rollout.keep_kv=true",
                               *user_environment.overrides("AnswerSomeTurns")), ("actor",),
                              async_save=False, model="qwen2-varied-lengths", save_freq=2),
    "grpo_lora_ep2": Job("configs/quickstart.yaml", "quickstart_grpo",
                         ("actor.ep=2", "actor.lora.rank=4", "actor.lora.alpha=8"), ("actor",), async_save=False,
                         model="qwen3-moe"),
}


@pytest.fixture(scope="module")
def arithmetic(tmp_path_factory):
    return make_arithmetic(64, 16, seed=0, out_dir=tmp_path_factory.mktemp("data"))


def _args(job: Job, model, data, out: Path, *extra: str) -> list[str]:
    train, test = data
    return ["--config", job.config, f"model.path={model}", f"data.train_files=[{train}]",
            f"data.val_files=[{test}]", f"trainer.output_dir={out}", f"trainer.checkpoint_dir={out}/ckpt",
            f"trainer.total_steps={TOTAL_STEPS}", f"trainer.save_freq={job.save_freq}", "trainer.test_freq=0",
            "trainer.log_freq=1",
            f"data.train_batch_size={TRAIN_BATCH_SIZE}", f"actor.ppo_mini_batch_size={MINI_BATCH_SIZE}",
            "data.max_val_samples=4", "actor.optim.lr=1e-3", f"trainer.async_save={str(job.async_save).lower()}",
            f"reward.function={ROOT / 'tests/integration/user_reward.py'}:compute_score", *job.overrides, *extra]


def _checkpoints(out: Path, job: Job) -> Path:
    return out / "ckpt" / job.experiment


def _latest_step(out: Path, job: Job) -> int:
    latest = _checkpoints(out, job) / "latest"
    return int(latest.read_text().removeprefix("global_step_")) if latest.is_file() else 0


def _metrics(out: Path, job: Job) -> dict[str, dict[int, float]]:
    """The last value logged at each step of every metric that does not measure time (a resumed
    job logs the steps after its checkpoint again)."""
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{out}/{job.experiment}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name(job.experiment).experiment_id])
    assert len(runs) == 1, "a resumed job must continue its mlflow run"
    names = [name for name in runs[0].data.metrics if not name.startswith(WALL_CLOCK)]
    return {name: {m.step: m.value for m in sorted(client.get_metric_history(runs[0].info.run_id, name),
                                                    key=lambda m: m.timestamp)} for name in names}


def _adam_steps(out: Path, job: Job, engine: str) -> set[float]:
    """The Adam step counts the final checkpoint saved for `engine` (one per param group; a mixture of experts has
    two optimizers, its experts' and the rest's)."""
    common = torch.load(_checkpoints(out, job) / f"global_step_{TOTAL_STEPS}" / engine / "common.pt",
                        weights_only=True)
    optimizers = common["optimizer"].values() if 0 in common["optimizer"] else [common["optimizer"]]
    return {group["step"] for optimizer in optimizers for group in optimizer["optimizer"]["param_groups"]}


def _assert_resumed(launch: Launch, loaded: int, finished: bool) -> None:
    """The job loaded checkpoint `loaded` and trained (and logged) the steps after it."""
    console = launch.console()
    assert re.search(rf"resumed from \S+/global_step_{loaded} \(step {loaded}\)", console), console[-2000:]
    logged = [int(step) for step in re.findall(r"^step (\d+): ", console, flags=re.MULTILINE)]
    expected = list(range(loaded + 1, TOTAL_STEPS + 1))
    assert logged == expected if finished else logged == expected[: len(logged)], (logged, loaded)


@pytest.fixture(scope="module")
def models(tiny_models, tiny_moe_models) -> dict[str, Path]:
    return {**tiny_models, **tiny_moe_models}


@pytest.fixture(scope="module")
def uninterrupted(models, arithmetic, tmp_path_factory) -> dict[str, tuple[Path, dict, dict]]:
    """One uninterrupted run per job: its output directory, its metrics and (split placement) the
    prompts and policy version of each step. Each logs every training metric at every step, validates
    before training and after the last step, and leaves its curves and config in its run directory."""
    results = {}
    for name, job in JOBS.items():
        out = tmp_path_factory.mktemp(f"uninterrupted_{name}")
        launch = Launch(out, _args(job, models[job.model], arithmetic, out))
        launch.finish()
        metrics = _metrics(out, job)
        for metric in ("actor/pg_loss", "reward/mean", *(("critic/vf_loss",) if "critic" in job.engines else ())):
            assert sorted(metrics[metric]) == list(range(1, TOTAL_STEPS + 1)), metric
        assert sorted(metrics["val/score/mean"]) == [0, TOTAL_STEPS]
        assert len(set(metrics["actor/grad_norm"].values())) > 1  # the weights really move
        # Split placement at staleness >= 1: the default rollout correction (auto) weights the lagging engine's tokens.
        assert ("actor/rollout_correction/weight_mean" in metrics) == ("trainer.placement=split" in job.overrides)
        # LoRA syncs only the adapted linears into vLLM: the layers left out keep their weights, without a warning.
        output = launch.console() + launch.log()
        assert "Failed to load weights" not in output and "were not loaded from checkpoint" not in output
        run_dir = out / job.experiment
        assert (run_dir / "config.yaml").is_file() and (run_dir / "curves.png").stat().st_size > 10_000
        results[name] = out, metrics, launch.trained_batches()
    return results


def _misplaced_tensors(checkpoint: Path) -> list[str]:
    """The tensors of a dist checkpoint directory whose bytes, where its index says they are, do not
    hold a tensor of the shape its metadata gives."""
    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    misplaced = []
    for index, where in metadata.storage_data.items():
        described = metadata.state_dict_metadata.get(index.fqn)
        if described is None:
            misplaced.append(f"{index.fqn}: stored but not described")
            continue
        if not hasattr(described, "chunks"):  # bytes, not a tensor
            continue
        chunk = next(c for c in described.chunks if tuple(c.offsets) == tuple(index.offset))
        with open(checkpoint / where.relative_path, "rb") as file:
            file.seek(where.offset)
            stored = file.read(where.length)
        try:
            shape = tuple(torch.load(io.BytesIO(stored), weights_only=True).shape)
        except Exception as error:  # noqa: BLE001 - any failure to read is the finding
            shape = repr(error)
        if shape != tuple(chunk.sizes):
            misplaced.append(f"{index.fqn}: {shape} stored, {tuple(chunk.sizes)} described")
    return misplaced


@pytest.mark.parametrize("name", JOBS)
def test_every_published_checkpoint_holds_what_its_index_says(uninterrupted, name):
    """Actor and critic saved asynchronously at the same step (PPO) each publish their own tensors."""
    job = JOBS[name]
    checkpoints = _checkpoints(uninterrupted[name][0], job)
    for step in range(job.save_freq, TOTAL_STEPS + 1, job.save_freq):
        for engine in job.engines:
            assert not _misplaced_tensors(checkpoints / f"global_step_{step}" / engine), (step, engine)


def _kills(name: str, checkpoints: Path) -> list:
    """When and how each launch dies: GRPO-DP2 (and LoRA at EP2) loses its agent during a rollout, then crashes during
    a save; PPO-TP2 crashes during an actor update, then during an asynchronous save (its shards still
    being written while the next step trains)."""
    if name == "grpo_split":  # the batch of step 3 (2) is queued: generated during the update of step 2 (3)
        return [(lambda launch: launch.phase_began(2, "update_actor"), Launch.crash),
                (lambda launch: launch.phase_began(3, "update_actor"), Launch.crash)]
    if name == "grpo_split_partial":  # both resume checkpoint 2, which holds trajectories in flight, some past their
        # first turn; the second dies after step 4's sync kept requests in the engine, which the resumed job redoes
        return [(lambda launch: launch.phase_began(3, "update_actor"), Launch.crash),
                (lambda launch: launch.phase_began(4, "update_actor"), Launch.crash)]
    if name in ("grpo_dp2", "grpo_lora_ep2"):
        return [(lambda launch: launch.phase_began(2, "rollout"), lambda launch: launch.kill_agent(checkpoints)),
                (lambda launch: (checkpoints / ".global_step_3.partial").is_dir(), Launch.crash)]

    def async_save_in_flight(launch):
        saving = [int(re.sub(r"\D", "", path.name)) for path in checkpoints.glob(".global_step_*.partial")]
        return any(launch.phase_began(step + 1, "rollout") for step in saving)

    # Step 3: the save of step 2 waited for that of step 1, so there is a checkpoint to resume from.
    return [(lambda launch: launch.phase_began(3, "update_actor"), Launch.crash), (async_save_in_flight, Launch.crash)]


@pytest.mark.parametrize("name", JOBS)
def test_a_job_killed_twice_resumes_bitwise(models, arithmetic, tmp_path, uninterrupted, name):
    job = JOBS[name]
    args = _args(job, models[job.model], arithmetic, tmp_path)
    checkpoints = _checkpoints(tmp_path, job)
    launch, loaded, trained = Launch(tmp_path, args), None, {}
    for moment, kill in _kills(name, checkpoints):
        launch.wait_for(lambda: moment(launch))
        kill(launch)
        if loaded is not None:
            _assert_resumed(launch, loaded, finished=False)
        loaded = _latest_step(tmp_path, job)
        assert 0 < loaded < TOTAL_STEPS, f"nothing to resume from, or nothing left to train ({loaded})"
        trained |= {step: batch for step, batch in launch.trained_batches().items() if step <= loaded}
        if name == "grpo_split_partial":  # the checkpoint resumed holds trajectories half generated
            state = torch.load(checkpoints / f"global_step_{loaded}/placement.pt", weights_only=True)
            in_flight = [r for group in state["rollout_partial"]["in_flight"] for r in group["responses"]]
            assert any(r["ids"] and r["finish_reason"] is None for r in in_flight), in_flight
            assert any(r["turn"]["num_turns"] and r["finish_reason"] is None for r in in_flight)  # to replay
        launch = Launch(tmp_path, args)
    launch.finish()
    _assert_resumed(launch, loaded, finished=True)
    assert _metrics(tmp_path, job) == uninterrupted[name][1]
    if "trainer.placement=split" in job.overrides:
        trained |= launch.trained_batches()
        assert trained == uninterrupted[name][2]
    if name == "grpo_split":
        assert [version for _, version in trained.values()] == [0, 0, 1, 2]  # staleness 0, then 1: the bound
    if name == "grpo_split_partial":  # some trajectories were continued on newer weights, over several turns
        assert max(uninterrupted[name][1]["rollout/multi_version_responses"].values()) > 0
        assert max(uninterrupted[name][1]["rollout/kept_requests"].values()) > 0  # through some syncs
        assert max(uninterrupted[name][1]["agent/turns"].values()) > 1
    for engine in job.engines:
        assert _adam_steps(tmp_path, job, engine) == {float(TOTAL_STEPS * TRAIN_BATCH_SIZE // MINI_BATCH_SIZE)}


# DP2 -> PP2 loads DP-sharded optimizer state at DP1 onto two pipeline stages; TP2 -> DP2 loads
# TP-sharded weights and optimizer state whole, then shards the optimizer state over DP.
@pytest.mark.parametrize(("name", "layout"), [("grpo_dp2", "actor.pp=2"), ("ppo_tp2", "actor.tp=1")])
def test_a_checkpoint_resumes_at_another_layout(tiny_models, arithmetic, tmp_path, uninterrupted, name, layout):
    """The uninterrupted run's checkpoint of step 2 (DP2 or TP2), resumed at PP2 or DP2."""
    job = JOBS[name]
    reference_out, reference, _ = uninterrupted[name]
    shutil.copytree(_checkpoints(reference_out, job) / "global_step_2", _checkpoints(tmp_path, job) / "global_step_2")
    shutil.copytree(reference_out / job.experiment, tmp_path / job.experiment,
                    ignore=shutil.ignore_patterns("*.png", "config.yaml"))  # the mlflow run the job continues
    launch = Launch(tmp_path, _args(job, tiny_models["qwen2-tied"], arithmetic, tmp_path, *layout.split(),
                                    "trainer.resume_mode=path",
                                    f"trainer.resume_path={_checkpoints(tmp_path, job) / 'global_step_2'}"))
    launch.finish()
    _assert_resumed(launch, 2, finished=True)
    resumed = _metrics(tmp_path, job)
    # The same weights generate the same responses; losses differ only by fp32 reduction order.
    assert resumed["reward/mean"] == reference["reward/mean"]
    for metric in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", *(("critic/vf_loss",) if "critic" in
                                                                           job.engines else ())):
        for step, value in reference[metric].items():
            assert resumed[metric][step] == pytest.approx(value, abs=1e-4), (metric, step)
