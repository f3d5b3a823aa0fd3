"""A generative reward model: an LLM judge reads a rubric with the problem and a candidate response, and
its verdict, parsed, is the response's reward.

    judge = JudgeRewards(generate, JudgeRubric(template, choices={"correct": 1.0, "wrong": 0.0}))
    result = judge.score(items)        # the RewardManager interface: a RewardResult

The pieces are pure: `render_judge_prompt` fills the rubric, `parse_verdict` reads a verdict, and
`JudgeRewards` batches a step's items into one call of `generate` (prompt texts in, verdict texts out;
`megarl.generation.judge` serves it with a rollout engine) and mixes the verdicts with a rule reward.

A verdict is either one of named `choices` (each with its score; the first choice to appear in the text
as a whole word, so that "correct" is not found in "incorrect"), or with no choices a number in
[0, max_score], scaled to [0, 1]. A judge is a model, so a verdict may be neither: it scores 0 and is
counted, never fatal. A verdict that stops without a parse is *unparsable*; one that ran into the judge's
token budget without a parse is a *timeout*: the budget, not a clock, bounds a judge's time (an engine's
batched generation cannot be interrupted for one of its requests). Both are per-item flags among the
result's extras, so the step logs their rates as `reward/judge_unparsable` and `reward/judge_timeouts`.

Mixing: score = (1 - rule_weight) * verdict + rule_weight * rule score; with rule_weight 0 the rule
function is not called at all (the data may have no rule to call).

Failures: an item whose judge was not asked (`Verdict.error`) is a *judge error*, one whose rule call
failed or timed out a *rule failure*; both are per-item flags among the extras (`reward/judge_errors`,
`reward/rule_failures`). The result's `num_errors` counts the items that got no reward from any source: the
judge errors, or when mixed the items with both a judge error and a rule failure (an item that one source
scores keeps that source's share of its reward, and is no failure). Each item counts once, as an error, so
the trainer stops exactly when no item of a step got a reward (`Rollouts.require_rewards`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

from megarl.rewards.manager import RewardManager, RewardResult, ScoringItem

PLACEHOLDERS = ("prompt", "response", "ground_truth")
"""What a template may name, in braces: the prompt's text, the candidate response, the reference answer."""

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def render_judge_prompt(template: str, prompt: str, response: str, ground_truth: str) -> str:
    """The judge's prompt: `template` (str.format syntax; literal braces doubled) with its placeholders filled."""
    return template.format(prompt=prompt, response=response, ground_truth=ground_truth)


def check_template(template: str) -> None:
    """ValueError naming the first placeholder outside PLACEHOLDERS, or a malformed brace."""
    try:
        render_judge_prompt(template, "", "", "")
    except KeyError as error:
        raise ValueError(f"names {{{error.args[0]}}}; allowed placeholders: "
                         f"{', '.join('{' + name + '}' for name in PLACEHOLDERS)}") from None
    except (ValueError, IndexError) as error:  # a lone brace, or a positional {} / {0}
        raise ValueError(f"is not a format string ({error}); write a literal brace as {{{{ or }}}}") from None


def parse_verdict(text: str, choices: dict[str, float], max_score: float) -> float | None:
    """The score a verdict gives, or None if it gives none: with `choices`, the score of the first one found
    in `text` as a whole word (case-insensitive); without, the first number in `text`, divided by
    `max_score` (a number outside [0, max_score] is no verdict)."""
    if choices:
        words = sorted(choices, key=len, reverse=True)  # at one position, the longest choice wins
        pattern = r"(?<!\w)(" + "|".join(map(re.escape, words)) + r")(?!\w)"
        match = re.search(pattern, text, flags=re.IGNORECASE)
        if match is None:
            return None
        by_lower = {word.lower(): score for word, score in choices.items()}
        return by_lower[match.group(1).lower()]
    match = _NUMBER.search(text)
    if match is None:
        return None
    value = float(match.group())
    return value / max_score if 0 <= value <= max_score else None


@dataclass(frozen=True)
class JudgeRubric:
    template: str
    """The judge's prompt, with PLACEHOLDERS in braces."""
    choices: dict[str, float] = field(default_factory=dict)
    """Verdict words and their scores; empty: the verdict is a number in [0, max_score]."""
    max_score: float = 1.0
    rule_weight: float = 0.0
    """The rule function's share of the reward."""


@dataclass(frozen=True)
class Verdict:
    text: str
    truncated: bool = False
    """The judge's generation hit its token budget."""
    error: str | None = None
    """Why the judge was not asked (its prompt too long): a judge error, counted in reward/errors unless a
    mixed-in rule scores the item."""


class JudgeRewards:
    def __init__(self, generate: Callable[[list[str]], list[Verdict]], rubric: JudgeRubric,
                 rule: RewardManager | None = None):
        """`generate`: one verdict per judge prompt, in order. `rule`: the rule reward mixed in (needed when
        `rubric.rule_weight` > 0)."""
        if rubric.rule_weight and rule is None:
            raise ValueError("a judge with rule_weight > 0 needs a rule reward to mix in")
        self.generate, self.rubric, self.rule = generate, rubric, rule

    def score(self, items: list[ScoringItem]) -> RewardResult:
        """Every item judged in one batch; extras `judge_score` (the verdict's score, NaN without one),
        `judge_unparsable`, `judge_timeouts`, `judge_errors` (0/1 flags) and, when mixed, `rule_score` and
        `rule_failures` (0/1: the rule's call failed or timed out)."""
        rubric = self.rubric
        prompts = [render_judge_prompt(rubric.template, item.prompt, item.solution_str, item.ground_truth)
                   for item in items]
        verdicts = self.generate(prompts) if prompts else []
        assert len(verdicts) == len(items), (len(verdicts), len(items))
        parsed = [None if v.error else parse_verdict(v.text, rubric.choices, rubric.max_score) for v in verdicts]
        judged = [0.0 if p is None else p for p in parsed]
        unread = [p is None and v.error is None for p, v in zip(parsed, verdicts)]  # asked, but no verdict read
        not_asked = [v.error is not None for v in verdicts]
        result = RewardResult(scores=judged, failed=not_asked, extra={
            "judge_score": [math.nan if p is None else p for p in parsed],
            "judge_unparsable": [float(u and not v.truncated) for u, v in zip(unread, verdicts)],
            "judge_timeouts": [float(u and v.truncated) for u, v in zip(unread, verdicts)],
            "judge_errors": [float(n) for n in not_asked],
        })
        unjudged = [(item, v.error) for item, v in zip(items, verdicts) if v.error]
        if unjudged:
            item, error = unjudged[0]
            result.first_error = f"{item.origin or 'an item'} (data_source {item.data_source!r}): judge: {error}"
        if rubric.rule_weight:
            rule = self.rule.score(items)
            weight = rubric.rule_weight
            result.scores = [(1 - weight) * j + weight * r for j, r in zip(judged, rule.scores)]
            result.extra.update(rule.extra)
            result.extra["rule_score"] = rule.scores
            result.extra["rule_failures"] = [float(f) for f in rule.failed]
            result.failed = [n and f for n, f in zip(not_asked, rule.failed)]  # failed: neither source scored it
            result.first_error = result.first_error or rule.first_error
        result.num_errors = sum(result.failed)
        return result
