"""A user reward function with the common signature, loaded by path through
`reward.function=.../user_reward.py:compute_score`.

Random tiny models never solve arithmetic, so rule rewards would all be 0; this one depends on the
response text and varies within groups, which DAPO's group filtering needs to keep anything.
With MEGARL_TEST_REWARD_CALLS set to a directory, each call appends a line to that directory's
file of the calling process, so a test can count the calls of the whole job: a JSON list of the
data source, the prompt's split and index (extra_info) and the response.
"""

import json
import os


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    calls = os.environ.get("MEGARL_TEST_REWARD_CALLS")
    if calls:
        with open(os.path.join(calls, f"{os.getpid()}.txt"), "a") as log:
            info = extra_info or {}
            log.write(json.dumps([data_source, info.get("split"), info.get("index"), solution_str]) + "\n")
    return {"score": float(sum(map(ord, solution_str)) % 2), "length": float(len(solution_str))}
