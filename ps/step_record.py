"""The trainer's one record of what it trained: each optimizer step's start, its wait for results, the result parts
it trained (ps/ledger.py GroupsTaken, which says their staleness) and the groups dynamic sampling dropped, gathered
over the steps since the last logged one.

ps/trainer.py feeds it once per event, and everything that reports a step reads it: the ``train_step_end`` event
(``step_trained``), TRL's logs to the report_to integrations (``trl_logs``), and the ``metrics.jsonl`` line
(``line``), from which the terminal's ``[train]`` line and ``queue_tools ls``'s ``training:`` line are formatted
(asyncgrpo/run/metrics.py ``step_words``).
"""

from __future__ import annotations

import statistics
import time

from asyncgrpo.run.metrics import StepMetrics
from ps.learning_signal import LearningSignal, finite


class StepRecord:
    def __init__(self, groups_dropped_before: int = 0, *, dynamic_sampling: bool = False):
        self.groups_dropped_total = groups_dropped_before  # by dynamic sampling, over the steps in metrics.jsonl
        self._dynamic_sampling = dynamic_sampling  # (TRL's logs carry the groups dropped only where it drops any)
        self._last_line = self._step_started = time.monotonic()
        self._step_wait_s = 0.0  # the optimizer step's wait for results
        self._new_span()

    def _new_span(self) -> None:
        """What the next line gathers, from the steps trained after the last one."""
        self.staleness: list[int] = []  # of each group trained: step - 1 - its result's version
        self.weights_versions: list[int] = []  # of each result trained from
        self.token_staleness = 0  # summed over the completion tokens trained: step - 1 - the version sampling each
        self.tokens = 0
        self.trainer_wait_s = 0.0  # the steps' waits for results
        self.groups_dropped = 0  # by dynamic sampling

    # ------------------------------------------------------------------ fed by the trainer

    def step_started(self) -> None:
        self._step_started, self._step_wait_s = time.monotonic(), 0.0

    def waited(self, seconds: float) -> None:
        """The step waited ``seconds`` for its batch."""
        self._step_wait_s += seconds
        self.trainer_wait_s += seconds

    def dropped(self, groups: int) -> None:
        """Dynamic sampling dropped ``groups`` groups to assemble the step's batch."""
        self.groups_dropped += groups

    def step_trained(self, step: int, parts) -> dict:
        """Step ``step`` trained ``parts``, results' groups; the fields of its ``train_step_end`` event."""
        staleness = [part.staleness(step) for part in parts]
        for part, stale in zip(parts, staleness, strict=True):
            self.staleness += [stale] * len(part.groups)
            self.weights_versions.append(part.weights_version)
            for tokens_staleness, tokens in part.tokens_by_staleness(step).items():
                self.token_staleness += tokens_staleness * tokens
                self.tokens += tokens
        return {"dur_ms": (time.monotonic() - self._step_started) * 1e3, "wait_ms": self._step_wait_s * 1e3,
                "staleness": max(staleness)}

    # ------------------------------------------------------------------ read

    @property
    def has_trained(self) -> bool:
        """A step has trained since the last line: a log of TRL's now is a step's (not an evaluation's)."""
        return bool(self.staleness)

    def trl_logs(self) -> dict:
        """The record's metrics under the names TRL's logs carry them to the report_to integrations."""
        logs = {"staleness/mean": statistics.fmean(self.staleness), "staleness/max": max(self.staleness),
                "staleness/token_mean": self.token_staleness / max(self.tokens, 1),
                "weights_version": max(self.weights_versions), "trainer_wait_s": round(self.trainer_wait_s, 4)}
        if self._dynamic_sampling:
            logs["dynamic_sampling/groups_dropped"] = self.groups_dropped
        return logs

    def line(self, step: int, logs: dict, signal: LearningSignal, prompts_skipped: int,
             queue_depth: dict[str, int]) -> StepMetrics:
        """The line of logged step ``step``: the record's metrics and TRL's averaged ``logs``, the learning signal's
        counts, the difficulty filter's ``prompts_skipped`` and the queue's depth; the next line gathers anew."""
        now = time.monotonic()
        self.groups_dropped_total += self.groups_dropped
        mine = self.trl_logs()
        line = StepMetrics(
            step=step, reward=finite(logs.get("reward")), reward_std=logs.get("reward_std"), loss=logs.get("loss"),
            grad_norm=logs.get("grad_norm"), staleness_mean=mine["staleness/mean"],
            staleness_max=mine["staleness/max"], token_staleness_mean=round(mine["staleness/token_mean"], 4),
            weights_version=mine["weights_version"], trainer_wait_s=mine["trainer_wait_s"],
            groups_dropped=self.groups_dropped, groups_dropped_total=self.groups_dropped_total,
            prompts_skipped=prompts_skipped, tool_failure_rate=logs.get("tools/failure_frequency"),
            frac_reward_zero_std=finite(logs.get("frac_reward_zero_std")),
            steps_without_reward=signal.steps_without_reward, steps_without_spread=signal.steps_without_spread,
            step_time_s=round(now - self._last_line, 4), queue_depth=queue_depth, time=time.time(),
            trl={name: value for name, value in logs.items()  # (numbers and words: a line is JSON)
                 if name not in mine and (value is None or isinstance(value, (int, float, str)))})
        self._last_line = now
        self._new_span()
        return line
