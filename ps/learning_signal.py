"""Steps that teach the policy nothing: said on the terminal, counted in ``metrics.jsonl``, and where they last,
the end of the run.

TRL's step reward is the mean over the step's rows of the reward functions' weighted sum, NaN-aware: a function
that returns None for a row does not apply to it (TRL's semantics, kept). A step teaches nothing when

- it has no reward: every function returned None (or NaN) for every row. Said in one line (at most once a
  minute), counted (``steps_without_reward``, in a row), and after NO_REWARD_STOP_STEPS such steps in a row the
  run stops, naming the cause, as jobs that always fail stop it (ps/failures.py);
- its rewards do not spread: every group's completions scored alike (TRL's ``frac_reward_zero_std`` is 1). GRPO's
  advantage is a completion's reward minus its group's mean: all 0, so the loss and its gradient are 0 (but for a
  KL term). Counted (``steps_without_spread``, in a row); from NO_SPREAD_WARN_STEPS in a row on, one WARN line,
  repeated at most once a minute, and ``queue_tools ls`` warns. Under ``--dynamic_sampling`` such groups are
  dropped, and no step comes while every group is: ``FlatGroups`` says so from NO_SPREAD_WARN_STEPS batches' groups
  dropped in a row on, in the same way;
- every completion was cut at ``--max_completion_length`` under ``--mask_truncated_completions``: TRL masks them all
  out of the loss. Said in one line, at most once a minute.

The counts go by optimizer steps: a logged line covers the steps since the previous one (``--logging_steps``),
whose metrics TRL averages, so a line says "none of them" only when none of them had a reward (or a spread).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from asyncgrpo.run.metrics import NO_REWARD_STOP_STEPS, NO_SPREAD_WARN_STEPS

log = logging.getLogger("asyncgrpo.ps")

REPEAT_WARNING_S = 60.0


def finite(value) -> float | None:
    """``value`` as a float, None for None and NaN (a step without a reward)."""
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


@dataclass
class LearningSignal:
    steps_without_reward: int = 0  # in a row, up to the last logged step
    steps_without_spread: int = 0
    stop: str | None = None  # why the run must stop, once it must
    _last_step: int = 0
    _warned_at: float = -math.inf

    @classmethod
    def resumed(cls, step: int, line: dict | None) -> LearningSignal:
        """The counts at ``step``, where a resumed run goes on from: its metrics line ``line`` (None: none kept)."""
        line = line or {}
        return cls(steps_without_reward=int(line.get("steps_without_reward") or 0),
                   steps_without_spread=int(line.get("steps_without_spread") or 0), _last_step=step)

    def observe(self, step: int, reward: float | None, frac_reward_zero_std: float | None,
                all_masked: bool = False) -> None:
        """A logged step (TRL's averages since the previous one): counts and says; sets ``stop`` once the run must
        stop (the caller stops it, after the step's line is written). ``all_masked``: every completion was cut and
        masked out of the loss."""
        steps, self._last_step = max(step - self._last_step, 1), step
        self.steps_without_reward = self.steps_without_reward + steps if reward is None else 0
        alike = reward is None or (frac_reward_zero_std is not None and frac_reward_zero_std >= 1.0)
        self.steps_without_spread = self.steps_without_spread + steps if alike else 0
        if self.steps_without_reward >= NO_REWARD_STOP_STEPS:
            self.stop = (
                f"{self.steps_without_reward} steps in a row without a reward: every reward function returned None "
                "(or NaN) for every completion, so nothing can be learned; a function returns None for the rows it "
                "does not apply to: check what yours return for this dataset")
        elif reward is None:
            self._say(f"step={step}: no reward: every reward function returned None (or NaN) for every completion "
                      f"({self.steps_without_reward} step(s) in a row; the run stops at {NO_REWARD_STOP_STEPS})")
        elif all_masked:
            self._say(f"step={step}: every completion reached --max_completion_length and --mask_truncated_completions "
                      "masked them all out of the loss: nothing is learned. Give a larger --max_completion_length, "
                      "or run without --mask_truncated_completions")
        elif self.steps_without_spread >= NO_SPREAD_WARN_STEPS:
            self._say(f"step={step}: for {self.steps_without_spread} steps every group's completions scored alike "
                      "(frac_reward_zero_std 1): the advantages are all 0 and nothing is learned. If reward "
                      f"{reward:.3f} is the task's best, the task is learned; else look at the reward (does it tell "
                      "this model's completions apart?), the model (do its completions differ?), or "
                      "--dynamic_sampling (trains only on groups whose rewards differ)")

    def _say(self, line: str) -> None:
        self._warned_at = say_once_a_minute(line, self._warned_at)


class FlatGroups:
    """Dynamic sampling's groups dropped in a row, none kept (each group's completions scored alike): while it lasts no
    step trains, and the run would go on without a word. From ``warn_at`` groups on, one WARN line, repeated at most
    once a minute."""

    def __init__(self, warn_at: int):
        self.warn_at, self.in_a_row, self._warned_at = warn_at, 0, -math.inf

    def observe(self, kept: int, dropped: int) -> None:
        """The groups of a result kept for training and dropped."""
        self.in_a_row = 0 if kept else self.in_a_row + dropped
        if self.in_a_row >= self.warn_at:
            self._warned_at = say_once_a_minute(
                f"--dynamic_sampling dropped the last {self.in_a_row} groups and kept none: each group's completions "
                "scored alike, so no step can train. Look at the reward (does it tell this model's completions "
                "apart?), the model (do its completions differ?), or run without --dynamic_sampling",
                self._warned_at)


def say_once_a_minute(line: str, warned_at: float) -> float:
    """``line`` as a WARN, unless one was said since ``warned_at`` less than a minute ago; when the last was said."""
    now = time.monotonic()
    if now - warned_at < REPEAT_WARNING_S:
        return warned_at
    log.warning("[train] %s", line)
    return now
