"""Reward functions that fail, for the failure-handling tests (loaded by import path, in real processes:
``--reward_funcs reward_faults:always_raises`` with this folder on PYTHONPATH)."""


def always_raises(prompts, completions, **kwargs):
    raise RuntimeError("the reward server is down")


def one_reward_too_few(prompts, completions, **kwargs):
    return [0.0] * (len(prompts) - 1)


def raises_on_digit_7(prompts, completions, **kwargs):
    """Scores like the demo reward, but raises on the prompt "7:" (one of the demo's ten digits)."""
    if "7:" in prompts:
        raise ValueError("cannot score the prompt '7:'")
    return [sum(c == p[0] for c in completion) / max(len(completion), 1) for p, completion in zip(prompts, completions)]
