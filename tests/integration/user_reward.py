"""A user reward function with the common signature, loaded by path through `reward.function=.../user_reward.py:compute_score`.

Random tiny models never solve arithmetic, so rule rewards would all be 0; this one depends on the
response text and varies within groups, which DAPO's group filtering needs to keep anything.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(sum(map(ord, solution_str)) % 2), "length": float(len(solution_str))}
