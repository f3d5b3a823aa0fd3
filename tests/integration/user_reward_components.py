"""A user reward function of two named components, for gdpo (`algorithm.reward_components=[parity,brevity]`):
the text's parity (as `user_reward.py` scores it) and a brevity bonus; their sum is the score."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    parity = float(sum(map(ord, solution_str)) % 2)
    brevity = 1.0 / (1.0 + len(solution_str))
    return {"score": parity + brevity, "parity": parity, "brevity": brevity}
