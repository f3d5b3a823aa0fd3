"""Rewards: rule scorers by data_source, user scoring functions, and the robust batch scorer."""

from megarl.rewards.custom import load_scoring_function
from megarl.rewards.manager import RewardFunctionError, RewardManager, RewardResult, ScoringItem, token_level_scores
from megarl.rewards.scorers import RULE_SCORERS, compute_score

__all__ = [
    "RULE_SCORERS",
    "RewardFunctionError",
    "RewardManager",
    "RewardResult",
    "ScoringItem",
    "compute_score",
    "load_scoring_function",
    "token_level_scores",
]
