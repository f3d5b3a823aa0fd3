"""Loading, round-tripping and rejecting run configs (megarl.config.loader)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import (
    ActorConfig,
    ConfigError,
    RunConfig,
    TrainerConfig,
    load_config,
    save_resolved,
    validate_batches,
    validate_layout,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY_CPU = str(REPO_ROOT / "configs" / "tiny_cpu.yaml")


def test_loads_yaml_into_dataclasses():
    config = load_config(TINY_CPU)
    assert isinstance(config, RunConfig)
    assert isinstance(config.actor, ActorConfig)
    assert isinstance(config.trainer, TrainerConfig)
    assert config.model.path == "outputs/tiny_qwen2"
    assert (config.actor.tp, config.actor.pp) == (1, 1)
    assert config.trainer.experiment_name == "tiny_cpu"
    assert config.trainer.total_steps == 3


def test_overrides_apply_after_yaml():
    config = load_config(TINY_CPU, ["actor.tp=2", "trainer.total_steps=5"])
    assert config.actor.tp == 2 and isinstance(config.actor.tp, int)
    assert config.trainer.total_steps == 5 and isinstance(config.trainer.total_steps, int)
    assert config.trainer.experiment_name == "tiny_cpu"  # untouched YAML values survive


def test_overrides_without_yaml():
    config = load_config(None, ["model.path=/models/x", "model.dtype=bfloat16"])
    assert config.model.path == "/models/x"
    assert config.model.dtype == "bfloat16"
    assert config.actor == ActorConfig()


def test_save_resolved_round_trips(tmp_path):
    config = load_config(TINY_CPU, ["actor.pp=2", "model.layer_spec=local", "trainer.seed=7"])
    saved = tmp_path / "run" / "config.yaml"
    save_resolved(config, saved)
    assert load_config(str(saved)) == config


SPLIT = ["model.path=m", "trainer.placement=split", "rollout.num_ranks=1"]


@pytest.mark.parametrize("overrides, preset", [
    (["model.path=m"], "none"),  # colocated: the engine has the trainer's weights
    ([*SPLIT, "trainer.max_staleness=0"], "none"),
    ([*SPLIT, "trainer.max_staleness=1"], "token_tis"),  # the engine's weights lag: truncated token weights
    ([*SPLIT, "trainer.max_staleness=2", "rollout.partial=true"], "token_tis"),
    ([*SPLIT, "trainer.max_staleness=1", "actor.recompute_old_logprobs=false"], "none"),  # the ratio is to the engine
    ([*SPLIT, "trainer.max_staleness=1", "algorithm.rollout_correction.preset=none"], "none"),  # as set
    (["model.path=m", "algorithm.rollout_correction.preset=seq_tis"], "seq_tis"),
])
def test_rollout_correction_auto_weights_tokens_where_the_engine_lags(overrides, preset):
    assert RunConfig().algorithm.rollout_correction.preset == "auto"
    assert load_config(None, overrides).algorithm.rollout_correction.preset == preset


M = "model: {path: m}\n"  # the required key, so each bad YAML below has exactly one mistake
P = "model.path=m"  # the same for configs given only as overrides


def bad(name, yaml_text, overrides, *fragments):
    """A bad config: YAML text (or None), overrides, fragments its one-line message must contain."""
    return pytest.param(yaml_text, overrides, fragments, id=name)


BAD_CONFIGS = [
    bad("typo key in yaml", M + "actor: {tpp: 2}", [], "'actor.tpp'", "bad.yaml", "did you mean 'actor.tp'"),
    bad("typo key in override", None, [P, "actor.tpp=2"], "'actor.tpp'", "did you mean 'actor.tp'"),
    bad("typo section in yaml", M + "trainr: {total_steps: 2}", [], "'trainr'", "did you mean 'trainer'"),
    bad("unknown key, no close match", M + "actor: {zzz: 1}", [], "'actor.zzz'", "'actor': tp, pp, cp, ep"),
    bad("wrong type int", M + "actor: {tp: two}", [], "'actor.tp' = 'two'", "not a valid int", "bad.yaml"),
    bad("wrong type int override", None, [P, "trainer.seed=1.5"], "'trainer.seed' = 1.5", "valid int"),
    bad("null for an int", M + "trainer: {total_steps: null}", [], "'trainer.total_steps'", "valid int"),
    bad("scalar for a section", M + "actor: 3", [], "'actor' = 3", "bad.yaml", "keys tp, pp, cp, ep"),
    bad("bad dtype", "model: {path: m, dtype: fp32}", [], "'model.dtype'", "float32, bfloat16, float16"),
    bad("bad layer_spec", None, [P, "model.layer_spec=te"], "'model.layer_spec'", "transformer_engine"),
    bad("tp zero", None, [P, "actor.tp=0"], "'actor.tp' = 0", ">= 1"),
    bad("negative pp", M + "actor: {pp: -2}", [], "'actor.pp' = -2", ">= 1"),
    bad("ep zero", None, [P, "actor.ep=0"], "'actor.ep' = 0", ">= 1"),
    bad("etp negative", None, [P, "actor.etp=-1"], "'actor.etp' = -1", ">= 0"),
    bad("etp apart from tp at ep1", None, [P, "actor.tp=2", "actor.etp=1"], "'actor.etp' = 1 differs from actor.tp = 2",
        "allowed: actor.etp = 0 or 2, or actor.ep > 1"),
    bad("negative aux loss", None, [P, "model.moe.aux_loss_coeff=-0.01"], "'model.moe.aux_loss_coeff' = -0.01",
        "numbers >= 0"),
    bad("negative z-loss", "model: {path: m, moe: {z_loss_coeff: -1.0}}", [], "'model.moe.z_loss_coeff' = -1.0",
        ">= 0"),
    bad("context parallel", None, [P, "actor.cp=2"], "'actor.cp' = 2", "not supported", "allowed: 1"),
    bad("critic mini-batch zero", None, [P, "critic.ppo_mini_batch_size=0"], "'critic.ppo_mini_batch_size' = 0",
        ">= 1"),
    bad("critic bad optimizer", None, [P, "critic.optim.optimizer=adamw"], "'critic.optim.optimizer'", "adam, sgd"),
    bad("prime update order", None, [P, "prime.update=during"], "'prime.update' = 'during'", "before, after"),
    bad("prime beta zero", None, [P, "prime.beta=0"], "'prime.beta' = 0", "> 0"),
    bad("unknown KL controller", None, [P, "algorithm.kl_ctrl.type=adaptiv"], "'algorithm.kl_ctrl.type'",
        "fixed, adaptive"),
    bad("unknown logger", M + "trainer: {loggers: [console, wandb]}", [], "'trainer.loggers' = 'wandb'",
        "console, mlflow"),
    bad("log_freq zero", None, [P, "trainer.log_freq=0"], "'trainer.log_freq' = 0", ">= 1"),
    bad("rollout tp zero", None, [P, "rollout.tp=0"], "'rollout.tp' = 0", ">= 1"),
    bad("multi-turn max_turns zero", None, [P, "rollout.multi_turn.max_turns=0"], "'rollout.multi_turn.max_turns' = 0",
        ">= 1"),
    bad("multi-turn with router replay", None, [P, "rollout.multi_turn.enable=true", "actor.router_replay=true"],
        "'actor.router_replay' = True", "rollout.multi_turn.enable"),
    bad("multi-turn reward source", None, [P, "rollout.multi_turn.reward=both"],
        "'rollout.multi_turn.reward' = 'both'", "environment, function, sum"),
    bad("tool timeout zero", None, [P, "rollout.multi_turn.tool_timeout_seconds=0"],
        "'rollout.multi_turn.tool_timeout_seconds' = 0", "> 0"),
    bad("sandbox memory zero", None, [P, "rollout.multi_turn.sandbox.memory_mib=0"],
        "'rollout.multi_turn.sandbox.memory_mib' = 0", ">= 1"),
    bad("unknown placement", None, [P, "trainer.placement=remote"], "'trainer.placement' = 'remote'",
        "colocated, split"),
    bad("rollout ranks when colocated", None, [P, "rollout.num_ranks=2"], "'rollout.num_ranks' = 2",
        "trainer.placement=split"),
    bad("split without rollout ranks", None, [P, "trainer.placement=split"], "'rollout.num_ranks' = 0", ">= 1"),
    bad("split rollout ranks not whole engines", None, [P, "trainer.placement=split", "rollout.num_ranks=3",
                                                        "rollout.tp=2"], "'rollout.num_ranks' = 3", "rollout.tp = 2"),
    bad("negative staleness", None, [P, "trainer.max_staleness=-1"], "'trainer.max_staleness' = -1", ">= 0"),
    bad("partial rollouts when colocated", None, [P, "rollout.partial=true"], "'rollout.partial' = True",
        "trainer.placement=split", "allowed: false"),
    bad("partial rollouts at staleness 0", None, [P, "trainer.placement=split", "rollout.num_ranks=1",
                                                  "rollout.partial=true"], "'rollout.partial' = true",
        "trainer.max_staleness >= 1"),
    bad("requests kept without partial rollouts", None, [P, "rollout.keep_kv=true"], "'rollout.keep_kv' = true",
        "rollout.partial=true", "allowed: false"),
    bad("requests kept but saved every step", None, [P, "trainer.placement=split", "rollout.num_ranks=1",
                                                     "trainer.max_staleness=2", "rollout.partial=true",
                                                     "rollout.keep_kv=true", "trainer.save_freq=1"],
        "'rollout.keep_kv' = true keeps no request with trainer.save_freq=1", "trainer.save_freq of 0 or >= 2"),
    bad("rollout correction cap below 1", None, [P, "algorithm.rollout_correction.cap=0.5"],
        "'algorithm.rollout_correction.cap' = 0.5", "numbers >= 1", "or null"),
    bad("rollout correction lower at 1", None, [P, "algorithm.rollout_correction.lower=1.0"],
        "'algorithm.rollout_correction.lower' = 1.0", "[0, 1)"),
    bad("rollout correction upper at 1", "model: {path: m}\nalgorithm: {rollout_correction: {upper: 0.9}}", [],
        "'algorithm.rollout_correction.upper' = 0.9", "> 1"),
    bad("rollout correction negative opsm", None, [P, "algorithm.rollout_correction.opsm_delta=-0.1"],
        "'algorithm.rollout_correction.opsm_delta' = -0.1", ">= 0"),
    bad("rollout correction bound not a number", None, [P, "algorithm.rollout_correction.upper=high"],
        "'algorithm.rollout_correction.upper' = 'high'", "not a valid float | None"),
    bad("lora rank negative", None, [P, "actor.lora.rank=-4"], "'actor.lora.rank' = -4", ">= 0"),
    bad("lora target not a projection", None, [P, "actor.lora.rank=8", "actor.lora.target_modules=[q_proj,lm_head]"],
        "'actor.lora.target_modules' = 'lm_head'", "q_proj, k_proj, v_proj, o_proj, q_a_proj, q_b_proj"),
    bad("lora without targets", None, [P, "critic.lora.rank=8", "critic.lora.target_modules=[]"],
        "'critic.lora.target_modules' is empty", "critic.lora.rank = 8"),
    bad("judge without a template", None, [P, "reward.judge.path=j"], "'reward.judge.template' is required",
        "{prompt}, {response} and {ground_truth}"),
    bad("judge choice an unquoted yes", M + "reward: {judge: {choices: {yes: 1.0, 'no': 0.0}}}", [],
        "'reward.judge.choices' has the key True (bool), not a string", "bad.yaml", 'quote it, e.g. "yes"'),
    bad("judge template names an unknown field", None, [P, "reward.judge.path=j", "reward.judge.template=A{answer}"],
        "'reward.judge.template' = 'A{answer}'", "names {answer}", "{prompt}, {response}, {ground_truth}"),
    bad("judge template with a lone brace", None, [P, "reward.judge.path=j", "reward.judge.template=a{b"],
        "'reward.judge.template' = 'a{b'", "not a format string", "{{"),
    bad("judge rule weight above 1", None, [P, "reward.judge.path=j", "reward.judge.template=A{response}",
                                           "reward.judge.rule_weight=1.5"], "'reward.judge.rule_weight' = 1.5",
        "[0, 1]"),
    bad("judge choice of infinite score", None, [P, "reward.judge.path=j", "reward.judge.template=A{response}",
                                                "reward.judge.choices={ok: .inf}"], "'reward.judge.choices'",
        "finite scores"),
    bad("judge max_score zero", None, [P, "reward.judge.path=j", "reward.judge.template=A{response}",
                                      "reward.judge.max_score=0"], "'reward.judge.max_score' = 0.0", "> 0"),
    bad("judge max_tokens zero", None, [P, "reward.judge.path=j", "reward.judge.template=A{response}",
                                       "reward.judge.max_tokens=0"], "'reward.judge.max_tokens' = 0", ">= 1"),
    bad("judge at rollout tp 2", None, [P, "reward.judge.path=j", "reward.judge.template=A{response}", "rollout.tp=2"],
        "'rollout.tp' = 2", "reward.judge.path", "allowed: 1"),
    bad("judge of multi-turn rollouts", None, [P, "reward.judge.path=j", "reward.judge.template=A{response}",
                                              "rollout.multi_turn.enable=true"], "'rollout.multi_turn.enable' = True",
        "reward.judge.path"),
    bad("train batch zero", None, [P, "data.train_batch_size=0"], "'data.train_batch_size' = 0", ">= 1"),
    bad("total_steps zero", None, [P, "trainer.total_steps=0"], "'trainer.total_steps' = 0", ">= 1"),
    bad("override without =", None, [P, "actor.tp"], "'actor.tp'", "key=value"),
    bad("override with empty key", None, ["=3"], "'=3'", "key=value"),
    bad("override with bad yaml value", None, [P, "actor.tp=[1"], "'actor.tp=[1'", "not valid YAML"),
    bad("yaml is a list", "- model\n- actor\n", [], "bad.yaml", "list",
        "model, actor, critic, prime, teacher, data, rollout, algorithm, reward, trainer"),
    bad("yaml syntax error", "model:\n  path: m\n bad: [\n", [], "bad.yaml", "not valid YAML"),
    bad("interpolation of unknown key", None, ["model.path=${nope}"], "'model.path'", "'nope' not found"),
    bad("interpolation of wrong type", None, [P, "actor.tp=${model.path}"], "'actor.tp' = 'm'", "int"),
    bad("model.path missing", "actor: {tp: 1}\n", [], "'model.path' is required", "model.path=<value>"),
]


@pytest.mark.parametrize("yaml_text, overrides, fragments", BAD_CONFIGS)
def test_bad_config_is_one_line_error(tmp_path, yaml_text, overrides, fragments):
    path = None
    if yaml_text is not None:
        path = tmp_path / "bad.yaml"
        path.write_text(yaml_text)
    with pytest.raises(ConfigError) as raised:
        load_config(None if path is None else str(path), overrides)
    message = str(raised.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml") as raised:
        load_config(str(missing))
    assert "\n" not in str(raised.value)


def _layout(*overrides: str) -> RunConfig:
    return load_config(None, [P, *overrides])


def test_layout_accepts_fitting_sizes():
    validate_layout(_layout("actor.tp=2", "actor.pp=2"), world_size=4)
    validate_layout(_layout("actor.tp=2", "rollout.tp=4"), world_size=8)
    validate_layout(_layout("actor.tp=2", "actor.ep=2", "actor.etp=1"), world_size=2)  # experts: ETP1 x EP2


def test_layout_rejects_an_expert_grid_that_does_not_fit():
    # TP2 fits 4 ranks, but each expert split over ETP2 on EP4 ranks needs 8.
    with pytest.raises(ConfigError,
                       match=r"world size 4 .*actor\.etp \* actor\.ep \* actor\.pp = 8; allowed: .*multiples of 8"):
        validate_layout(_layout("actor.tp=2", "actor.ep=4"), world_size=4)


def test_layout_rejects_indivisible_world_size():
    with pytest.raises(ConfigError, match=r"world size 3 .*actor\.tp.*= 2; allowed: .*multiples of 2"):
        validate_layout(_layout("actor.tp=2"), world_size=3)


def test_layout_rejects_rollout_tp_not_dividing_the_world():
    with pytest.raises(ConfigError, match=r"'rollout\.tp' = 4 does not divide world size 6; allowed: 1, 2, 3, 6$"):
        validate_layout(_layout("rollout.tp=4"), world_size=6)


# (overrides, world size, rl, fragments of the message); the DP sizes in the comments are worked out by hand.
BAD_BATCHES = [
    pytest.param(["data.train_batch_size=3", "rollout.n=8", "actor.tp=2"], 8, True,
                 ["'data.train_batch_size' = 3", "4 DP ranks", "at least 4"], id="fewer prompts than DP ranks"),
    pytest.param(["data.train_batch_size=1"], 2, False, ["'data.train_batch_size' = 1", "2 DP ranks", "at least 2"],
                 id="sft"),
    pytest.param(["data.train_batch_size=3", "actor.use_dynamic_batch_size=false"], 2, False,
                 ["'data.train_batch_size' = 3", "2 DP ranks", "a multiple of 2"], id="sft, fixed-size micro-batches"),
]


@pytest.mark.parametrize("overrides, world_size, rl, fragments", BAD_BATCHES)
def test_batches_that_do_not_split_over_dp_fail_naming_the_key(overrides, world_size, rl, fragments):
    config = _layout(*overrides)
    validate_layout(config, world_size)  # the layout itself fits
    with pytest.raises(ConfigError) as raised:
        validate_batches(config, world_size, rl)
    assert "\n" not in str(raised.value)
    for fragment in fragments:
        assert fragment in str(raised.value)


def test_batches_that_split_over_dp_pass():
    # RL: 2 prompts over DP 2 (world 4, TP 2), whatever the mini-batch; SFT: 6 sequences over DP 3.
    validate_batches(_layout("actor.ppo_mini_batch_size=1", "rollout.n=3", "data.train_batch_size=2",
                             "actor.tp=2"), 4, rl=True)
    validate_batches(_layout("data.train_batch_size=6", "rollout.n=5"), 3, rl=False)


