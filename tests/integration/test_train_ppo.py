"""The real launchers for a few steps: PPO with a critic at TP2xPP2xDP2 against TP1, multi-turn GRPO with a
KL loss at DP2 and at PP2 (actor.pp=2) against DP1, on-policy distillation at PP2, multi-turn PRIME at TP2
(actor and rollout engine), gdpo on a user reward of two named components at DP2, GRPO with LoRA at TP2.
(PPO with a critic at TP2 and its validation, curves and config in mlflow: test_checkpoint_resume.py's
uninterrupted runs.)

Each run logs to a local mlflow store, which the test reads back with mlflow's own client.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import mlflow
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.data.dataset import load_rows
from megarl.data.synthetic import make_arithmetic
from tests.conftest import ROOT, assert_succeeded, megarl_shared_memory, torchrun
from tests.integration import user_environment


@pytest.fixture(scope="module")
def arithmetic(tmp_path_factory):
    return make_arithmetic(64, 16, seed=0, out_dir=tmp_path_factory.mktemp("data"))


USER_REWARD = f"{ROOT / 'tests/integration/user_reward.py'}:compute_score"
# Trajectories of 3 model turns of at most 8 tokens, each of the first two answered by the environment with
# a user message (ANSWERED, at most 26 tokens; one fewer after a turn that ends with <|im_end|>): at most 76.
ANSWERED = "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
MULTI_TURN = [*user_environment.overrides(), "trainer.total_steps=3"]


def _check_trajectories(run_dir, experiment, model):
    """Every step's trajectories played 3 turns, the environment answered the first two (the budget leaves
    room), and its tokens, as the model's tokenizer encodes the template's ChatML, are out of the model's count."""
    answered = len(AutoTokenizer.from_pretrained(model)(ANSWERED, add_special_tokens=False)["input_ids"])
    assert _values(run_dir, experiment, "agent/turns") == [3.0] * 3
    assert _values(run_dir, experiment, "agent/tool_calls") == [2.0] * 3
    assert all(2 * answered - 2 <= v <= 2 * answered for v in _values(run_dir, experiment, "agent/environment_tokens"))
    assert all(3 <= v <= 24 for v in _values(run_dir, experiment, "agent/model_tokens"))


def _overrides(model, data, out, *extra):
    train, test = data
    return [f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{test}]",
            f"trainer.output_dir={out}", "trainer.total_steps=2", "trainer.test_freq=0", "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2", "data.max_val_samples=8",
            *extra]


def _history(run_dir, experiment, metric):
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])[0]
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, metric))


def _logged(run_dir, experiment, metric):
    return [step for step, _ in _history(run_dir, experiment, metric)]


def _values(run_dir, experiment, metric):
    return [value for _, value in _history(run_dir, experiment, metric)]


def test_ppo_at_tp2_pp2_dp2_matches_tp1(tiny_models, arithmetic, tmp_path):
    # 8 processes against 1, same seed. Rewards vary (random tiny models never solve arithmetic: the user
    # function scores the text's parity) and the critic starts from a value model, so that every loss
    # and gradient is nonzero from step 1. Every prompt samples with the same seed on whichever engine
    # replica holds it, so both runs see the same responses and rewards; losses differ only by the
    # order of fp32 sums (over TP shards, micro-batches and DP ranks), which Adam carries into later
    # steps' weights. Two micro-batches per DP rank keep the pipeline schedule busy. The `hf` engine:
    # the layouts under test are the trainer's (vLLM fed from TP2xPP2: tests/distributed/test_rollout.py),
    # and 8 vLLM engines on 2 cores would cost more than the training.
    histories = {}
    for name, nproc, layout in (("tp1", 1, []), ("tp2pp2dp2", 8, ["actor.tp=2", "actor.pp=2"])):
        out = tmp_path / name
        result = torchrun(nproc, ROOT / "launchers/train_ppo.py", "--config", "configs/quickstart_ppo.yaml",
                          *_overrides(tiny_models["qwen2-tied"], arithmetic, out, *layout, "data.val_files=[]",
                                      "actor.micro_batch_size_per_rank=2", "critic.micro_batch_size_per_rank=2",
                                      "rollout.backend=hf", f"critic.path={tiny_models['qwen2-value']}",
                                      f"reward.function={USER_REWARD}"),
                          timeout=900)
        assert_succeeded(result)
        assert _logged(out / "quickstart_ppo", "quickstart_ppo", "critic/vf_loss") == [1, 2]
        histories[name] = {metric: _values(out / "quickstart_ppo", "quickstart_ppo", metric)
                           for metric in ("reward/mean", "actor/pg_loss", "critic/vf_loss", "actor/grad_norm")}
    reference, three_d = histories["tp1"], histories["tp2pp2dp2"]
    assert all(value != 0 for metric in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm")
               for value in reference[metric])
    assert three_d["reward/mean"] == reference["reward/mean"]  # the same tokens, scored alike
    # Seen: relative differences <= 6e-7 in vf_loss and grad_norm; pg_loss (~1e-3) is a mean of O(1)
    # advantage terms that nearly cancel, so its error is absolute, 6e-8 (a few fp32 roundings of 1).
    for metric in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm"):
        assert three_d[metric] == pytest.approx(reference[metric], rel=1e-5, abs=1e-6), metric


def _grpo_variants(tiny_models, arithmetic, out, nproc, layout):
    """Multi-turn trajectories with a KL loss, token-level truncated IS, DAPO group filtering and overlong
    shaping, a Megatron reward model added to a user reward function loaded by path, which counts its calls;
    checked run on its own. Returns its run directory."""
    calls = out / "calls"
    calls.mkdir(parents=True)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("MEGARL_TEST_REWARD_CALLS", str(calls))
        result = torchrun(nproc, ROOT / "launchers/train_ppo.py", "--config", "configs/quickstart.yaml",
                          *_overrides(tiny_models["qwen3-tied"], arithmetic, out, "actor.use_kl_loss=true",
                                      "actor.loss_agg_mode=seq-mean-token-mean",
                                      "algorithm.rollout_correction.preset=token_tis",
                                      "actor.clip_ratio_high=0.28", "algorithm.filter_groups=true",
                                      "algorithm.overlong_buffer_length=2",
                                      f"reward.reward_model_path={tiny_models['qwen2-value']}",
                                      f"reward.function={USER_REWARD}", *MULTI_TURN, *layout),
                          timeout=600)
    assert_succeeded(result)
    run_dir = out / "quickstart_grpo"
    _check_trajectories(run_dir, "quickstart_grpo", tiny_models["qwen3-tied"])
    # Every trajectory is scored exactly once: 4 prompts x 8 samples per filter round, and 8
    # validation prompts x 1 sample before training and after the last step.
    rounds = _values(run_dir, "quickstart_grpo", "rollout/filter_rounds")
    num_calls = sum(len(f.read_text().splitlines()) for f in calls.iterdir())
    assert num_calls == 4 * 8 * sum(rounds) + 2 * 8, (layout, rounds, num_calls)
    for metric in ("actor/kl_loss", "mismatch/kl", "rollout/filter_rounds", "actor/grad_norm", "reward/length",
                   "actor/rollout_correction/token_kept_fraction"):
        assert _logged(run_dir, "quickstart_grpo", metric) == [1, 2, 3], metric
    return run_dir


@pytest.fixture(scope="module")
def grpo_variants_at_dp1(tiny_models, arithmetic, tmp_path_factory):
    """The reference run of the multi-turn GRPO variants, on 1 process (shared by the layouts compared to it)."""
    return _grpo_variants(tiny_models, arithmetic, tmp_path_factory.mktemp("dp1"), 1, [])


@pytest.mark.parametrize("nproc, layout", [(2, []), (2, ["actor.pp=2"])], ids=["dp2", "pp2"])
def test_multi_turn_grpo_variants_give_the_run_at_dp1(tiny_models, arithmetic, tmp_path, grpo_variants_at_dp1,
                                                      nproc, layout):
    run_dir = _grpo_variants(tiny_models, arithmetic, tmp_path, nproc, layout)
    # The same seed gives the same trajectories, rewards and per-step losses at DP1, DP2 and PP2.
    for metric in ("reward/function_mean", "reward/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm",
                   "agent/model_tokens", "mismatch/logprob_abs_diff_max", "actor/rollout_correction/weight_mean"):
        reference, other = (_values(run, "quickstart_grpo", metric) for run in (grpo_variants_at_dp1, run_dir))
        assert other == pytest.approx(reference, rel=1e-4, abs=1e-6), metric
    # The pieces' effects on the batch and loss are checked on real tensors in tests/unit/trainer
    # (test_scores.py: group filtering, reward model, overlong penalty; test_losses.py: rollout corrections);
    # here: the reward model's scores reach the rewards, on top of the function's 0/1 parity scores.
    total, function = (_values(run_dir, "quickstart_grpo", m) for m in ("reward/mean", "reward/function_mean"))
    assert all(0 <= f <= 1 for f in function) and all(abs(t - f) > 1e-6 for t, f in zip(total, function))


def test_grpo_at_tp2_pp2_dp2_on_vllm_engines_at_tp2(tiny_models, arithmetic, tmp_path, monkeypatch):
    # The whole 3D path on vLLM: 8 processes train at TP2xPP2xDP2 and generate on 4 vLLM engines of TP2,
    # fed by the resharding sync every step. The engines' log-probs of their own samples match the
    # trainer's (the weights arrived whole and in place), and each sequence is scored exactly once
    # though both ranks of an engine hold it: 4 prompts x 8 samples x 2 steps, and 8 validation
    # prompts before training and after the last step. vLLM's engines of TP2 on an AVX-512 CPU talk
    # through shared-memory segments: the run leaves none in /dev/shm.
    calls = tmp_path / "calls"
    calls.mkdir()
    monkeypatch.setenv("MEGARL_TEST_REWARD_CALLS", str(calls))
    shared_memory_before = megarl_shared_memory()
    result = torchrun(8, ROOT / "launchers/train_ppo.py", "--config", "configs/quickstart.yaml",
                      *_overrides(tiny_models["qwen2-untied"], arithmetic, tmp_path, "actor.tp=2", "actor.pp=2",
                                  "rollout.tp=2", f"reward.function={USER_REWARD}"),
                      timeout=900)
    assert_succeeded(result)
    assert megarl_shared_memory() <= shared_memory_before
    run = tmp_path / "quickstart_grpo"
    assert sum(len(f.read_text().splitlines()) for f in calls.iterdir()) == 4 * 8 * 2 + 2 * 8
    mismatch = _values(run, "quickstart_grpo", "mismatch/logprob_abs_diff_max")
    assert len(mismatch) == 2 and max(mismatch) < 1e-3, mismatch


def test_remax_baseline_is_the_greedy_reward(tiny_models, tmp_path):
    # Four prompts, trained as step 1's whole batch and validated (greedily, by the validation's own
    # code) before it: the greedy baseline's mean at step 1 is the step-0 validation score. The user
    # reward scores the text's parity, so the greedy responses score a mix of 0 and 1. The `hf`
    # engine: the greedy pass is the trainer's request (vLLM's greedy: every run's validation).
    train, _ = make_arithmetic(4, 4, seed=0, out_dir=tmp_path / "data")
    result = torchrun(1, ROOT / "launchers/train_ppo.py", "--config", "configs/quickstart.yaml",
                      *_overrides(tiny_models["llama-untied"], (train, train), tmp_path,
                                  "algorithm.adv_estimator=remax", "rollout.backend=hf", "trainer.total_steps=1",
                                  "data.max_val_samples=4",
                                  f"reward.function={ROOT / 'tests/integration/user_reward.py'}:compute_score"),
                      timeout=600)
    assert_succeeded(result)
    run = tmp_path / "quickstart_grpo"
    validated = dict(_history(run, "quickstart_grpo", "val/score/mean"))[0]
    assert _values(run, "quickstart_grpo", "reward/greedy_baseline_mean") == [pytest.approx(validated)]
    assert 0 < validated < 1


def test_gdpo_trains_on_two_named_reward_components_at_dp2(tiny_models, arithmetic, tmp_path):
    reward = f"{ROOT / 'tests/integration/user_reward_components.py'}:compute_score"
    result = torchrun(2, ROOT / "launchers/train_ppo.py", "--config", "configs/quickstart.yaml",
                      *_overrides(tiny_models["qwen2-tied"], arithmetic, tmp_path, "rollout.backend=hf",
                                  "algorithm.adv_estimator=gdpo", "algorithm.reward_components=[parity,brevity]",
                                  f"reward.function={reward}", "trainer.total_steps=3"),
                      timeout=600)
    assert_succeeded(result)
    run = tmp_path / "quickstart_grpo"
    for metric in ("reward/parity", "reward/brevity", "advantages/mean", "actor/pg_loss"):
        assert _logged(run, "quickstart_grpo", metric) == [1, 2, 3], metric
    # Each step's score is the sum of its components' means; the advantages are whitened over the whole
    # batch's tokens (both DP shares' sums), so their token mean is 0.
    for total, parity, brevity in zip(*(_values(run, "quickstart_grpo", m)
                                        for m in ("reward/mean", "reward/parity", "reward/brevity"))):
        assert total == pytest.approx(parity + brevity, rel=1e-5)
    assert _values(run, "quickstart_grpo", "advantages/mean") == pytest.approx([0.0] * 3, abs=1e-5)


def test_engine_logprobs_serve_as_the_old_policys(tiny_models, arithmetic, tmp_path):
    # A single-step update's old log-probs are the trainer's own (its forward before the step), so its
    # ratio is 1 on every token and actor/approx_kl exactly 0; with actor.recompute_old_logprobs=false
    # they are the engine's, which differ from the trainer's in the last digits (other kernels): the mean
    # log ratio is not 0, and small. Nothing compares the two, so nothing logs their mismatch.
    result = torchrun(1, ROOT / "launchers/train_ppo.py", "--config", "configs/quickstart.yaml",
                      *_overrides(tiny_models["qwen2-tied"], arithmetic, tmp_path, "actor.ppo_mini_batch_size=4",
                                  "actor.recompute_old_logprobs=false"),
                      timeout=600)
    assert_succeeded(result)
    run = tmp_path / "quickstart_grpo"
    approx_kl = _values(run, "quickstart_grpo", "actor/approx_kl")
    assert len(approx_kl) == 2 and all(0 < abs(v) < 1e-3 for v in approx_kl), approx_kl
    for metric in ("mismatch/kl", "rollout/entropy"):
        assert _logged(run, "quickstart_grpo", metric) == [], metric


def test_opd_at_pp2_with_the_student_as_teacher_has_zero_kl(tiny_models, arithmetic, tmp_path):
    # The teacher is a second model loaded from a copy of the student's weights: it must give every sampled
    # token the student's log-prob (same tokens, same temperature, 0.7 here), so the reverse KL and the
    # advantages are 0 and the policy gradient vanishes. A misaligned or unscaled teacher score is not 0.
    # Any engine's samples do (`hf`: no vLLM start-up).
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_models["qwen2-tied"], teacher)
    result = torchrun(2, ROOT / "launchers/train_ppo.py", "--config", "configs/quickstart.yaml",
                      *_overrides(tiny_models["qwen2-tied"], arithmetic, tmp_path, "actor.pp=2",
                                  "rollout.temperature=0.7", "algorithm.adv_estimator=opd", f"teacher.path={teacher}",
                                  "rollout.backend=hf"),
                      timeout=600)
    assert_succeeded(result)
    run = tmp_path / "quickstart_grpo"
    assert _logged(run, "quickstart_grpo", "teacher/reverse_kl") == [1, 2]
    for metric in ("teacher/reverse_kl", "advantages/max", "advantages/min", "actor/pg_loss"):
        assert max(abs(v) for v in _values(run, "quickstart_grpo", metric)) < 1e-5, metric
    # The teacher's log-probs are real ones: a near-uniform tiny model over 101 tokens at T=0.7.
    assert all(-5.0 < v < -1.0 for v in _values(run, "quickstart_grpo", "teacher/logprob_mean"))
def test_prime_at_tp2_trains_its_prm_on_the_outcome_labels(tiny_models, arithmetic, tmp_path):
    # The PRM starts from the SFT model and shares the run's reference (the KL loss builds it); one PRM
    # optimizer step per RL step, before the rewards (the paper's order), so the step's accuracy before
    # the update is on responses the PRM has not seen and the rewards' accuracy is after training on them.
    # Multi-turn trajectories on a TP2 rollout engine: its second rank receives the environment's answers.
    result = torchrun(2, ROOT / "launchers/train_ppo.py", "--config", "configs/prime_quickstart.yaml",
                      *_overrides(tiny_models["qwen2-tied"], arithmetic, tmp_path, "actor.tp=2", "rollout.tp=2",
                                  "actor.use_kl_loss=true", "prime.ppo_mini_batch_size=4", "prime.optim.lr=1e-4",
                                  f"reward.function={USER_REWARD}", *MULTI_TURN),
                      timeout=600)
    assert_succeeded(result)
    run_dir = tmp_path / "quickstart_prime"
    _check_trajectories(run_dir, "quickstart_prime", tiny_models["qwen2-tied"])
    for metric in ("prime/prm_loss", "prime/token_reward/mean", "prime/grad_norm", "advantages/mean"):
        assert _logged(run_dir, "quickstart_prime", metric) == [1, 2, 3], metric
    before, after = (_values(run_dir, "quickstart_prime", f"prime/{m}") for m in ("prm_accuracy", "reward_accuracy"))
    # At the first step the PRM equals its reference: every implicit reward is 0, P(correct) one half.
    assert before[0] == 0.5 and _values(run_dir, "quickstart_prime", "prime/prm_loss")[0] == pytest.approx(math.log(2))
    # The cross-entropy step raises the PRM's accuracy at telling the step's correct responses from the others.
    assert all(a > b for a, b in zip(after, before)), (before, after)


JUDGE_TEMPLATE = "Q {prompt}{response} key {ground_truth} score"
JUDGE_CHOICES = {"o": 1.0, "d": 0.0}


def _judged(tokenizer, model, prompt: str, response: str, ground_truth: str) -> tuple[float | None, bool]:
    """The judge's one-token verdict by transformers' greedy generation, and its score by JUDGE_CHOICES (None for
    another token): (the score, whether the judge wrote a token rather than stopping)."""
    text = JUDGE_TEMPLATE.format(prompt=prompt, response=response, ground_truth=ground_truth)
    ids = tokenizer(text, return_tensors="pt").input_ids
    new = model.generate(ids, max_new_tokens=1, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
    return JUDGE_CHOICES.get(tokenizer.decode(new, skip_special_tokens=True).lower()), new != [tokenizer.eos_token_id]


@pytest.mark.parametrize("placement", [[], ["trainer.placement=split", "rollout.num_ranks=1"]],
                         ids=["colocated", "split"])
def test_grpo_rewarded_by_a_judge_mixed_with_the_rule(tiny_models, arithmetic, tmp_path, monkeypatch, placement):
    # Two processes, each with the policy's vLLM engine and a judge's beside it (split: a trainer, and a rollout rank
    # with both engines): a random tiny model, whose one-token verdicts are whatever it writes; two of its favourite
    # characters are the choices, so that some verdicts are read and others are not. Each step's rewards are
    # recomputed here from the responses the rule function was called with: the judge's greedy verdicts by
    # transformers, read by hand, mixed half and half with the parity the function scores; the validation is the
    # function's alone.
    calls = tmp_path / "calls"
    calls.mkdir()
    monkeypatch.setenv("MEGARL_TEST_REWARD_CALLS", str(calls))
    judge = tiny_models["qwen2-tied"]
    result = torchrun(2, ROOT / "launchers/train_ppo.py", "--config", "configs/quickstart.yaml",
                      *_overrides(tiny_models["qwen3-tied"], arithmetic, tmp_path, f"reward.function={USER_REWARD}",
                                  f"reward.judge.path={judge}", f"reward.judge.template={JUDGE_TEMPLATE}",
                                  "reward.judge.choices={o: 1.0, d: 0.0}", "reward.judge.max_tokens=1",
                                  "reward.judge.rule_weight=0.5", "reward.judge.max_prompt_length=48", *placement),
                      timeout=600)
    assert_succeeded(result)
    run = tmp_path / "quickstart_grpo"
    train = {row["extra_info"]["index"]: row for row in load_rows([arithmetic[0]])}
    steps = {1: [], 2: []}  # per generating process: its prompts x 8 samples of step 1, then of step 2
    validations = {0: [], 2: []}  # and its validation prompts before training, then after the last step
    files = list(calls.iterdir())
    assert len(files) == (1 if placement else 2)
    per_step, per_validation = 32 // len(files), 8 // len(files)
    for file in files:
        lines = [json.loads(line) for line in file.read_text().splitlines()]
        trained = [(index, response) for _, split, index, response in lines if split == "train"]
        validated = [response for _, split, _, response in lines if split == "test"]
        assert len(trained) == 2 * per_step and len(validated) == 2 * per_validation
        steps[1] += trained[:per_step]
        steps[2] += trained[per_step:]
        validations[0] += validated[:per_validation]
        validations[2] += validated[per_validation:]

    def parity(response):
        return sum(map(ord, response)) % 2

    tokenizer = AutoTokenizer.from_pretrained(judge)
    model = AutoModelForCausalLM.from_pretrained(judge, dtype=torch.float32)
    parsed = 0
    metrics = ("reward/mean", "reward/rule_score", "reward/judge_unparsable", "reward/judge_timeouts")
    for step, scored in steps.items():
        verdicts = [_judged(tokenizer, model, train[i]["prompt"][0]["content"], response,
                            train[i]["reward_model"]["ground_truth"]) for i, response in scored]
        rewards = [0.5 * (score or 0.0) + 0.5 * parity(response) for (score, _), (_, response) in zip(verdicts, scored)]
        logged = {metric: dict(_history(run, "quickstart_grpo", metric))[step] for metric in metrics}
        assert logged["reward/mean"] == pytest.approx(sum(rewards) / 32, abs=1e-6), step
        assert logged["reward/rule_score"] == pytest.approx(sum(parity(r) for _, r in scored) / 32, abs=1e-6)
        assert logged["reward/judge_unparsable"] == pytest.approx(
            sum(score is None and not cut for score, cut in verdicts) / 32, abs=1e-6)
        assert logged["reward/judge_timeouts"] == pytest.approx(
            sum(score is None and cut for score, cut in verdicts) / 32, abs=1e-6)
        parsed += sum(score is not None for score, _ in verdicts)
    assert 0 < parsed < 64  # both kinds of verdict were met
    for step, responses in validations.items():
        validated = dict(_history(run, "quickstart_grpo", "val/score/mean"))[step]
        assert validated == pytest.approx(sum(map(parity, responses)) / 8, abs=1e-6)


def _launch_one(*args):
    command = [sys.executable, "launchers/train_ppo.py", *map(str, args)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_unknown_estimator_lists_the_registered_ones(tiny_models, arithmetic, tmp_path):
    result = _launch_one("--config", "configs/quickstart.yaml",
                         *_overrides(tiny_models["qwen2-tied"], arithmetic, tmp_path, "algorithm.adv_estimator=grpoo"))
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert "algorithm.adv_estimator" in message and "grpo, " in message and "rloo" in message


def test_unreadable_parquet_names_the_file(tiny_models, arithmetic, tmp_path):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not a parquet file")
    result = _launch_one("--config", "configs/quickstart.yaml",
                         *_overrides(tiny_models["qwen2-tied"], arithmetic, tmp_path, f"data.train_files=[{broken}]"))
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("megarl: ") and str(broken) in message


def test_grpo_with_lora_syncs_the_merged_adapted_linears_and_its_reference_is_the_base(tiny_models, arithmetic,
                                                                                        tmp_path):
    # LoRA (rank 8, every projection) at TP2 with a KL loss against the reference model, which is the actor with
    # its adapters off: at step 1, before any update, the adapters add zero (B = 0), so the KL is exactly 0; after
    # updates it is not. The engines (TP1) keep the base weights; after the first sync (the validation before
    # training) each sync sends W + (alpha / r) B A of the adapted linears alone: each engine rank receives the
    # other TP rank's half of them (their bytes read from the checkpoint here), the lower bound, and its log-probs
    # match the trainer's. The checkpoint holds the adapters and their optimizer state, no base weight;
    # generate.py on it serves the base read from model.path with the trained adapters (the run's last validation
    # again), not the base alone (whose greedy responses differ); it exports as a merged HF model and a PEFT adapter,
    # and not onto other base weights.
    model = tmp_path / "base"  # a copy: the end of the test changes its weights
    shutil.copytree(tiny_models["qwen2-untied"], model)
    overrides = _overrides(model, arithmetic, tmp_path, "rollout.backend=hf", "actor.tp=2", "actor.lora.rank=8",
                           "actor.use_kl_loss=true", "actor.ppo_mini_batch_size=4", "actor.optim.lr=1e-2",
                           "trainer.total_steps=3", f"reward.function={USER_REWARD}", "trainer.save_freq=3",
                           f"trainer.checkpoint_dir={tmp_path}/checkpoints")
    assert_succeeded(torchrun(2, ROOT / "launchers/train_ppo.py", "--config", "configs/quickstart.yaml", *overrides,
                              timeout=600))
    run = tmp_path / "quickstart_grpo"
    kl = _values(run, "quickstart_grpo", "actor/kl_loss")
    assert kl[0] == 0.0 and kl[-1] > 1e-3, kl
    mismatch = _values(run, "quickstart_grpo", "mismatch/logprob_abs_diff_max")
    assert len(mismatch) == 3 and max(mismatch) < 1e-4, mismatch
    linears = sum(tensor.numel() * tensor.element_size() for file in model.glob("*.safetensors")
                  for name, tensor in load_file(file).items() if name.endswith("_proj.weight"))
    assert _logged(run, "quickstart_grpo", "sync/bytes_received") == [2, 3]
    assert _values(run, "quickstart_grpo", "sync/bytes_received") == [linears / 2] * 2
    assert _values(run, "quickstart_grpo", "sync/bytes_over_lower_bound") == [1.0] * 2
    checkpoint = tmp_path / "checkpoints/quickstart_grpo/global_step_3"
    saved = FileSystemReader(str(checkpoint / "actor")).read_metadata().state_dict_metadata
    assert any(".lora_" in key for key in saved) and not [key for key in saved if key.endswith(".weight")]
    responses = {}
    for name, path in (("trained", checkpoint), ("base", model)):
        output = tmp_path / f"{name}.jsonl"
        assert_succeeded(torchrun(2, ROOT / "launchers/generate.py", "--config", "configs/quickstart.yaml",
                                  "--output", output, *overrides, f"model.path={path}"))
        rows = [json.loads(line) for line in output.read_text().splitlines()]
        responses[name] = [row["response"] for row in rows]
        if name == "trained":
            mean = sum(row["score"] for row in rows) / len(rows)
            assert mean == pytest.approx(dict(_history(run, "quickstart_grpo", "val/score/mean"))[3])
    assert responses["trained"] != responses["base"]
    # Exported merged and as a PEFT adapter (convert_to_hf.py --peft-output): PEFT's base with that adapter is the
    # merged model.
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert_succeeded(torchrun(1, ROOT / "checkpoints_tools/convert_to_hf.py", "--checkpoint", checkpoint,
                              "--output", merged, "--peft-output", adapter))
    tokens = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        base_logits = base(tokens).logits
        peft_logits = PeftModel.from_pretrained(base, adapter)(tokens).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(tokens).logits
    assert (merged_logits - base_logits).abs().max() > 1e-2  # training moved the adapters
    assert (merged_logits - peft_logits).abs().max() < 1e-4
    # Other weights of the same shapes at model.path (one tensor's first row moved): the adapters are not loaded
    # on them; one line names the path.
    weights = sorted(model.glob("*.safetensors"))[0]
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name][0] += 1e-3
    save_file(tensors, weights, metadata={"format": "pt"})
    result = torchrun(1, ROOT / "checkpoints_tools/convert_to_hf.py", "--checkpoint", checkpoint,
                      "--output", tmp_path / "on_another_base")
    assert result.returncode != 0
    messages = [line for line in result.stderr.splitlines() if "trained on other base weights" in line]
    assert len(messages) == 1 and messages[0].startswith("convert_to_hf: "), result.stderr[-2000:]
    assert f"than those at {model} now" in messages[0]


def test_grpo_with_lora_on_vllm_engines_that_take_whole_updates(tiny_models, arithmetic, tmp_path):
    # LoRA at TP2 on vLLM engines of TP1: each engine needs the other TP rank's half, so no sync copies into the
    # engine's own places, and vLLM's direct load takes every layer whole: every sync sends every tensor (the
    # adapted linears merged), and the engines' log-probs match the trainer's after the adapters moved.
    overrides = _overrides(tiny_models["qwen2-untied"], arithmetic, tmp_path, "actor.tp=2", "actor.lora.rank=8",
                           "actor.optim.lr=1e-2", "trainer.total_steps=3", "trainer.val_before_train=false")
    assert_succeeded(torchrun(2, ROOT / "launchers/train_ppo.py", "--config", "configs/quickstart.yaml", *overrides))
    run = tmp_path / "quickstart_grpo"
    mismatch = _values(run, "quickstart_grpo", "mismatch/logprob_abs_diff_max")
    assert len(mismatch) == 3 and max(mismatch) < 1e-4, mismatch
    received = _values(run, "quickstart_grpo", "sync/bytes_received")  # step 1's is the first, whole sync's
    assert received == received[:1] * 3 and _values(run, "quickstart_grpo", "sync/bytes_over_lower_bound") == [1.0] * 3
