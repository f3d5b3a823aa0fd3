"""An RL run's inputs, opened one way by every program that generates or trains on them: the trainer,
under split placement the rollout ranks (which draw the same prompts in the same order), and
`launchers/generate.py` (its prompts and reward function).

    inputs = RunInputs.open(config)   # tokenizer, train/validation prompts, sampler, reward function
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from megarl.agent.tools import tool_schemas
from megarl.config.schema import RunConfig
from megarl.data.prompt_dataset import PromptDataset
from megarl.data.sampler import ResumableSampler
from megarl.rewards import RewardManager, load_scoring_function


@dataclass
class RunInputs:
    tokenizer: PreTrainedTokenizerBase
    train_data: PromptDataset
    val_data: PromptDataset | None
    sampler: ResumableSampler
    """The training prompts' order (seeded by trainer.seed)."""
    rewards: RewardManager

    @classmethod
    def open(cls, config: RunConfig) -> RunInputs:
        """Fails in seconds with a one-line error on a bad data file or reward function."""
        tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        data = config.data
        train_data = prompt_dataset(config, tokenizer, data.train_files)
        return cls(tokenizer, train_data, prompt_dataset(config, tokenizer, data.val_files) if data.val_files else None,
                   ResumableSampler(len(train_data), data.train_batch_size, config.trainer.seed, shuffle=data.shuffle),
                   reward_manager(config))


def prompt_dataset(config: RunConfig, tokenizer: PreTrainedTokenizerBase, files: list[str]) -> PromptDataset:
    """The prompts of `files` as the run renders them (chat template, the multi-turn tools' preamble), those
    over `data.max_prompt_length` tokens dropped."""
    data = config.data
    return PromptDataset(files, tokenizer, data.max_prompt_length, data.apply_chat_template,
                         tools=tool_schemas(config.rollout.multi_turn))


def reward_manager(config: RunConfig) -> RewardManager:
    """The run's reward function (`reward.function`, default: the rule scorers) with its timeout."""
    return RewardManager(load_scoring_function(config.reward.function), config.reward.timeout_seconds)


def validation_prompts(val_data: PromptDataset, max_samples: int) -> list:
    """The first `max_samples` validation prompts (0: all), the same at every validation."""
    return [val_data[i] for i in range(min(max_samples or len(val_data), len(val_data)))]
