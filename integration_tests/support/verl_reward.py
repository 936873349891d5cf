"""Test support: the reward of the CPU ``main_ppo`` runs, loaded by verl from this file's path.

``reward.custom_reward_function.path=<this file>``: a plain function of the response text with
spread inside a GRPO group, so advantages are non-zero. Kept free of imports (verl loads the
file with ``importlib`` outside ``sys.modules``).
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The share of distinct characters among the first 32 of the response, in [0, 1]."""
    return len(set(solution_str[:32])) / 32.0
