"""A reward function that answers as a remote judge or a sandbox would: `hpcrl.rewards.exact_match`
after a wait per sample that holds no CPU (LATENCY_REWARD_WAIT_S, default 1 ms). Used by
`tools/bench_async.py --reward-wait-ms` and tests/test_demos.py, with this directory on PYTHONPATH:

    reward.functions = ["latency_reward:exact_match_after_a_wait"]
"""

from __future__ import annotations

import os
import time

from hpcrl import rewards

WAIT_S = float(os.environ.get("LATENCY_REWARD_WAIT_S", "0.001"))


def exact_match_after_a_wait(response: str, ground_truth: str, **kwargs) -> dict:
    time.sleep(WAIT_S)
    return rewards.exact_match(response, ground_truth, **kwargs)
