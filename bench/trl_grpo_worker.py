"""TRL's GRPOTrainer on the bench task, one process; run by bench/trl_vs_megarl.py in the bench environment.

Writes a JSON record: the seconds of every training step (generation + update, measured from the
trainer's step-begin to step-end callbacks), the prompt + completion tokens of every step, and the
held-out greedy accuracy before training and every --eval-every steps (0: never; evaluation time is not
part of any step).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from megarl.rewards.scorers import arithmetic_score  # noqa: E402  (pure Python: the same rule as megarl's)


def load_task(path: str) -> dict[str, list[str]]:
    """The common parquet layout -> plain-text prompts (message contents, as megarl renders them
    without a chat template) and their ground truths."""
    rows = pq.read_table(path).to_pylist()
    return {"prompt": ["\n".join(m["content"] for m in row["prompt"]) for row in rows],
            "ground_truth": [row["reward_model"]["ground_truth"] for row in rows]}


def correct(completions: list[str], ground_truth: list[str], **_) -> list[float]:
    return [arithmetic_score(completion, truth) for completion, truth in zip(completions, ground_truth)]


@torch.no_grad()
def greedy_accuracy(model, tokenizer, test: dict[str, list[str]], max_new_tokens: int) -> float:
    inputs = tokenizer(test["prompt"], return_tensors="pt", padding=True, padding_side="left",
                       add_special_tokens=False)
    was_training = model.training
    model.eval()
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model.train(was_training)
    completions = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(correct(completions, test["ground_truth"])) / len(completions)


class Record(TrainerCallback):
    """Step times, tokens per step and held-out accuracy, with evaluation outside the step times."""

    def __init__(self, tokenizer, test: dict[str, list[str]], eval_every: int, max_new_tokens: int):
        self.tokenizer, self.test, self.eval_every, self.max_new_tokens = tokenizer, test, eval_every, max_new_tokens
        self.step_seconds: list[float] = []
        self.tokens_seen: list[float] = []
        self.accuracy: list[tuple[int, float]] = []
        self._started = 0.0

    def on_train_begin(self, args, state, control, model=None, **_):
        if self.eval_every:
            self.accuracy.append((0, greedy_accuracy(model, self.tokenizer, self.test, self.max_new_tokens)))

    def on_step_begin(self, args, state, control, **_):
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **_):
        self.step_seconds.append(time.perf_counter() - self._started)
        if self.eval_every and (state.global_step % self.eval_every == 0 or state.global_step == state.max_steps):
            accuracy = greedy_accuracy(model, self.tokenizer, self.test, self.max_new_tokens)
            self.accuracy.append((state.global_step, accuracy))
            print(f"trl step {state.global_step}: held-out accuracy {accuracy:.3f}", flush=True)

    def on_log(self, args, state, control, logs=None, **_):
        if logs and "num_tokens" in logs:
            self.tokens_seen.append(logs["num_tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("--model", "--train", "--test", "--output"):
        parser.add_argument(name, required=True)
    for name in ("--steps", "--eval-every", "--prompts-per-step", "--samples", "--max-response-length", "--seed"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), required=True,
                        help="bfloat16: TRL's default mixed precision (bf16 autocast over fp32 weights)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    test = load_task(args.test)
    record = Record(tokenizer, test, args.eval_every, args.max_response_length)
    config = GRPOConfig(
        output_dir=str(Path(args.output).parent / "trl_run"), use_cpu=True, seed=args.seed, report_to="none",
        save_strategy="no", logging_steps=1, max_steps=args.steps, disable_tqdm=True,
        per_device_train_batch_size=args.prompts_per_step * args.samples, gradient_accumulation_steps=1,
        num_generations=args.samples, max_completion_length=args.max_response_length, temperature=1.0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, loss_type="dapo", scale_rewards="group",  # = megarl's grpo with token-mean, no KL
        bf16=args.dtype == "bfloat16",
    )
    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=config,
                          train_dataset=Dataset.from_dict(load_task(args.train)), processing_class=tokenizer,
                          callbacks=[record])
    generation_seconds = time_calls(trainer, "_generate_and_score_completions")
    trainer.train()
    tokens = [b - a for a, b in zip([0.0] + record.tokens_seen, record.tokens_seen)]
    Path(args.output).write_text(json.dumps({"step_seconds": record.step_seconds, "step_tokens": tokens,
                                             "accuracy": record.accuracy, "generation_seconds": generation_seconds}))


def time_calls(trainer, method: str) -> list[float]:
    """Wrap one of the trainer's methods to record the seconds of each call (a profile of its step:
    TRL generates, scores and computes advantages in `_generate_and_score_completions`)."""
    seconds, original = [], getattr(trainer, method)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return result

    setattr(trainer, method, timed)
    return seconds


if __name__ == "__main__":
    main()
