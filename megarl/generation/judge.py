"""The run's training rewards: the reward function's, or a generative judge's (`reward.judge`) served by a
rollout engine of its own, built by the one engine builder.

    rewards = training_rewards(config, inputs.rewards)   # on every rank that generates, after its policy engine

The judge engine is created on every rank that generates, after the policy's engine, beside it: both
vLLM engines share vLLM's groups of the world (so they have one TP size, `rollout.tp`, which the config
loader holds to 1: a response is scored on its replica's first rank alone, and a TP judge would need
every rank of the replica). On CPU it has its own KV cache (`reward.judge.kv_cache_mib`) and its weights
for the whole run; on GPU its share of memory (`reward.judge.gpu_memory_utilization`), awake throughout.
It is never synced (the judge does not train) and not shut down: vLLM's teardown destroys every process
group of the process, which the policy engine's shutdown, the job's last collective call, still needs; the
judge's engine ends with the process. Verdicts are greedy, so a response's reward does not depend on which
rank judged it.
"""

from __future__ import annotations

from transformers import AutoTokenizer

from megarl.config.schema import RunConfig
from megarl.data.tokenization import unchecked_prompt_ids
from megarl.generation.engine import EngineSettings, start_rollout_engine
from megarl.rewards import RewardManager
from megarl.rewards.judge import JudgeRewards, JudgeRubric, Verdict
from megarl.rollout import RolloutEngine, Sampling
from megarl.seeding import derive_seed


def training_rewards(config: RunConfig, rule: RewardManager) -> RewardManager | JudgeRewards:
    """What scores the training responses: the judge, mixed with `rule` by its weight, when
    `reward.judge.path` names one; else `rule` (the reward function). Collective over the world with a judge."""
    judge = config.reward.judge
    if not judge.path:
        return rule
    rubric = JudgeRubric(judge.template, dict(judge.choices), judge.max_score, judge.rule_weight)
    return JudgeRewards(JudgeEngine.of_run(config), rubric, rule)


class JudgeEngine:
    """Judge prompts in, greedy verdicts out, on the judge's engine."""

    def __init__(self, engine: RolloutEngine, tokenizer, apply_chat_template: bool, max_prompt_length: int,
                 sampling: Sampling):
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.apply_chat_template, self.max_prompt_length = apply_chat_template, max_prompt_length

    @classmethod
    def of_run(cls, config: RunConfig) -> JudgeEngine:
        """The judge `reward.judge` names, its engine started (collective over the world)."""
        judge = config.reward.judge
        tokenizer = AutoTokenizer.from_pretrained(judge.path)
        eos = tokenizer.eos_token_id
        sampling = Sampling(n=1, temperature=0.0, max_tokens=judge.max_tokens,
                            stop_token_ids=(eos,) if eos is not None else (),
                            seed=derive_seed(config.trainer.seed, "judge"))
        engine = start_rollout_engine(EngineSettings.of_judge(config), dummy_weights=False)
        return cls(engine, tokenizer, judge.apply_chat_template, judge.max_prompt_length, sampling)

    def __call__(self, prompts: list[str]) -> list[Verdict]:
        """Each prompt as the user's message (the judge's chat template, or the text as it is), judged in one call;
        a prompt over `max_prompt_length` tokens is not (its verdict carries the error)."""
        ids = unchecked_prompt_ids([[{"role": "user", "content": text}] for text in prompts], self.tokenizer,
                                   self.apply_chat_template)
        verdicts = {i: Verdict("", error=f"its prompt has {len(row)} tokens, over reward.judge.max_prompt_length = "
                                         f"{self.max_prompt_length}")
                    for i, row in enumerate(ids) if len(row) > self.max_prompt_length}
        fits = [i for i in range(len(ids)) if i not in verdicts]
        if fits:
            output = self.engine.generate([ids[i] for i in fits], self.sampling)
            texts = self.tokenizer.batch_decode(output.response_ids, skip_special_tokens=True)
            for i, text, reason in zip(fits, texts, output.finish_reasons):
                verdicts[i] = Verdict(text, truncated=reason == "length")
        return [verdicts[i] for i in range(len(prompts))]
