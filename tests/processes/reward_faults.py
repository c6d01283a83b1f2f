"""Reward functions that fail, for the failure-handling tests (loaded by import path in real processes:
``--reward_funcs tests.processes.reward_faults:always_raises``)."""


def always_raises(prompts, completions, **kwargs):
    raise RuntimeError("the reward server is down")


def one_reward_too_few(prompts, completions, **kwargs):
    return [0.0] * (len(prompts) - 1)


def raises_on_digit_0(prompts, completions, **kwargs):
    """Scores like the demo reward, but raises on a job holding the prompt "0:" (with seed 0, the 4th and the
    10th of the demo's first 20 jobs, never two in a row)."""
    if "0:" in prompts:
        raise ValueError("cannot score the prompt '0:'")
    return [sum(c == p[0] for c in completion) / max(len(completion), 1)
            for p, completion in zip(prompts, completions, strict=True)]


def hangs_where_told(prompts, completions, **kwargs):
    """The demo reward, except in a process whose environment names a marker file in ASYNCGRPO_TEST_HANG: there it
    creates that file and hangs (until the test kills the process), holding every job it claimed."""
    import os
    import time

    marker = os.environ.get("ASYNCGRPO_TEST_HANG")
    if marker:
        open(marker, "w").close()
        while True:
            time.sleep(1)
    return [sum(c == p[0] for c in completion) / max(len(completion), 1)
            for p, completion in zip(prompts, completions, strict=True)]


def slow_once_when_told(prompts, completions, **kwargs):
    """The demo reward, except in a process whose environment names a folder in ASYNCGRPO_TEST_SLOW: once the
    test creates ``go`` there, the next call creates ``slow`` and returns only once the test creates ``release``
    (a reward server having a bad minute; at most ASYNCGRPO_TEST_SLOW_S seconds), then creates ``done``; every
    other call is fast."""
    import os
    import time
    from pathlib import Path

    folder = os.environ.get("ASYNCGRPO_TEST_SLOW")
    if folder and (Path(folder) / "go").exists() and not (Path(folder) / "slow").exists():
        (Path(folder) / "slow").touch()
        deadline = time.monotonic() + float(os.environ["ASYNCGRPO_TEST_SLOW_S"])
        while not (Path(folder) / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        (Path(folder) / "done").touch()
    return [sum(c == p[0] for c in completion) / max(len(completion), 1)
            for p, completion in zip(prompts, completions, strict=True)]


def hangs_on_prompt_7(prompts, completions, **kwargs):
    """The demo reward, except that it never returns for a job holding the prompt "7:" (a scoring service that
    hangs on some inputs: one demo prompt in ten)."""
    import time

    while "7:" in prompts:
        time.sleep(1)
    return [sum(c == p[0] for c in completion) / max(len(completion), 1)
            for p, completion in zip(prompts, completions, strict=True)]


def never_applies(prompts, completions, **kwargs):
    """A reward function that applies to no row (TRL's None: the function does not apply to that row)."""
    return [None] * len(prompts)
