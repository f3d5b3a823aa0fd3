"""Supervised fine-tuning on the RL data layout: a warm start for RL.

Each prompt is followed by its reference response: a multi-turn trace (`extra_info["turns"]`:
assistant messages with tool results between them) rendered as the tokens a multi-turn rollout of
it holds (`ChatRenderer.continuation`); else the text of `extra_info["answer"]` when the row has one,
else the ground truth, and the end-of-text token. The prompt is tokenized as RL and generation
tokenize it (its special tokens included, and with `rollout.multi_turn.enable` the tools preamble of
`rollout.multi_turn.tools`, so the warm start and the RL run after it see the same opening); the
response continues it, so it gets none. The loss is the token-mean negative log-likelihood of the
model's tokens of the response: all of a text answer, the assistant turns of a trace (their contents
and end-of-turn tokens), not the tool results and turn headers between them (the loss mask, as in RL).
The result is exported as a HF checkpoint in `<run_dir>/hf`, ready to be `model.path` of an RL run.
"""

from __future__ import annotations

from transformers import AutoTokenizer

from megarl.agent.rendering import ChatRenderer
from megarl.agent.tools import tool_schemas
from megarl.algorithms import aggregate
from megarl.data.dataset import Prompt
from megarl.data.prompt_dataset import PromptDataset
from megarl.data.sampler import ResumableSampler
from megarl.data.tokenization import continuation_ids, uses_chat_template
from megarl.distributed.process import freeze_start_up_objects
from megarl.engine.batch import SequenceBatch
from megarl.engine.batching import balance_over_data_parallel
from megarl.engine.megatron_engine import MegatronEngine
from megarl.models.hf_interop import export_hf
from megarl.tracking import Tracker
from megarl.trainer.startup import Run


def reference_response(prompt: Prompt, tokenizer, renderer: ChatRenderer | None,
                       max_response_length: int) -> tuple[list[int], list[int]]:
    """The reference response of `prompt` as ids and its loss mask: its trace rendered by `renderer`
    (None: the data are not rendered with a chat template) cut to `max_response_length`, or its text cut
    to leave room for the end-of-text token, all of it learned."""
    turns = prompt.extra_info.get("turns") if prompt.extra_info else None
    if turns:
        if renderer is None:
            raise ValueError(f"data.train_files prompt {prompt.index}: extra_info.turns needs a chat template "
                             "(data.apply_chat_template=true and a tokenizer with one)")
        try:  # parquet fills a message's absent fields (a tool's name) with None
            ids, loss_mask = renderer.continuation([{k: v for k, v in m.items() if v is not None} for m in turns])
        except ValueError as error:
            raise ValueError(f"data.train_files prompt {prompt.index}, extra_info.turns: {error}") from None
        return ids[:max_response_length], loss_mask[:max_response_length]
    # Parquet reads a struct's absent fields back as None: rows without an answer in a file with some.
    answer = prompt.extra_info.get("answer") if prompt.extra_info else None
    text = prompt.ground_truth if answer is None else answer
    ids = continuation_ids(str(text), tokenizer)[: max_response_length - 1] + [tokenizer.eos_token_id]
    return ids, [1] * len(ids)


def sft_batch(prompts: list[Prompt], references: list[tuple[list[int], list[int]]], pad_token_id: int) -> SequenceBatch:
    """The batch of `prompts` followed by their `references` (ids, loss mask): the loss mask is the
    batch's response mask, which the loss averages over."""
    return SequenceBatch.from_sequences([prompt.prompt_ids for prompt in prompts], [ids for ids, _ in references],
                                        pad_token_id, loss_masks=[loss_mask for _, loss_mask in references])


def negative_log_likelihood(outputs, micro_batch, normalizer):
    mask_BR = micro_batch.response_mask_BR.to(outputs["logprobs"].device)
    nll = aggregate(-outputs["logprobs"], mask_BR, "token-mean", normalizer.num_tokens)
    return nll, {"sft/nll": nll.detach()}


class SFTTrainer:
    def __init__(self, run: Run):
        self.config, self.layout, self.run_dir = run.config, run.layout, run.run_dir
        config = self.config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        tools = tool_schemas(config.rollout.multi_turn)
        self.data = PromptDataset(config.data.train_files, self.tokenizer, config.data.max_prompt_length,
                                  config.data.apply_chat_template, tools=tools)
        prompts = list(self.data)  # read once: for the traces and the references
        # Only traces are rendered: text answers train with any template.
        traces = any(prompt.extra_info.get("turns") for prompt in prompts)
        renderer = (ChatRenderer(self.tokenizer, tools)
                    if traces and uses_chat_template(self.tokenizer, config.data.apply_chat_template) else None)
        self.references = [reference_response(prompt, self.tokenizer, renderer, config.data.max_response_length)
                           for prompt in prompts]
        self.sampler = ResumableSampler(len(self.data), config.data.train_batch_size, config.trainer.seed,
                                        shuffle=config.data.shuffle)
        run.save_config()
        self.engine = MegatronEngine(self.layout, config.model, config.actor,
                                     total_optimizer_steps=config.trainer.total_steps)
        self.tracker = Tracker(config.trainer.loggers, self.run_dir,
                               config.trainer.experiment_name, config.trainer.mlflow_tracking_uri, config,
                               is_writer=self.layout.rank == 0, log_freq=config.trainer.log_freq,
                               last_step=config.trainer.total_steps)

    def batch(self, indices: list[int]) -> SequenceBatch:
        """This DP rank's share of the examples `indices`, balanced by tokens over the DP ranks."""
        lengths = [len(self.data[i].prompt_ids) + len(self.references[i][0]) for i in indices]
        share = [indices[k] for k in balance_over_data_parallel(lengths, self.layout.dp)[self.layout.dp_rank]]
        return sft_batch([self.data[i] for i in share], [self.references[i] for i in share],
                         self.tokenizer.pad_token_id or 0)

    def fit(self) -> None:
        freeze_start_up_objects()
        with self.tracker:
            for step in self.tracker.progress(range(1, self.config.trainer.total_steps + 1)):
                batch = self.batch(self.sampler.next_batch())
                metrics, _ = self.engine.train_mini_batch(batch, negative_log_likelihood)
                moe = {f"actor/{key}": value for key, value in metrics.items() if key.startswith("moe/")}
                self.tracker.log({"sft/nll": metrics["sft/nll"], "actor/grad_norm": metrics["grad_norm"],
                                  "actor/lr": metrics["lr"], **moe}, step)
            export_hf(self.engine.module, self.engine.arch, self.layout, str(self.run_dir / "hf"),
                      self.config.model.path)
