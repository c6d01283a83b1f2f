"""``RUN/metrics.jsonl``: one JSON line per logged training step (docs/design.md, "The run directory").

The PS appends a line after each logged optimizer step (ps/trainer.py), and when it resumes removes the
lines of steps after its checkpoint: those steps are trained again, and the file keeps each step once.
``queue_tools ls`` shows the newest line, read from the file's tail; the report's timeline and plots read
every line.

A line is readable when it is a JSON object whose ``step`` is a number; any other (one cut short by a crash, one
written over by hand) is skipped by the readers and removed by ``truncate_after``. An evaluation's metrics
(``--eval_strategy``: TRL's ``eval_*`` names) are a line of their own, ``"kind": "eval"`` (``eval_line``); the
readers return the training steps' lines unless asked for ``kind="eval"``. Readers get the line's
dict: a line written by another version of asyncgrpo may lack some of ``StepMetrics``' keys.

No torch here: ``queue_tools ls`` reads this file without loading it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass

from asyncgrpo.run import fileops

# How much of the file's end last_line reads: a step's line is 1-3 KB (TRL's metrics in it grow with the reward
# functions), an evaluation's as much, so this holds several.
TAIL_BYTES = 65536

# Steps that teach nothing (ps/learning_signal.py): the PS stops after this many steps in a row without a reward,
# and warns (as do `queue_tools ls` and `report`) from this many in a row whose groups all scored alike.
NO_REWARD_STOP_STEPS = 20
NO_SPREAD_WARN_STEPS = 20


def step_words(line: dict, queue: str | None = None, dropped_prompts: int = 0) -> str:
    """A step's line as the terminal's ``[train]`` line and ``queue_tools ls``'s ``training:`` line show it (one
    format): its step, reward (``-``: no reward function scored a row), staleness, the trainer's wait for results
    and loss; then the queue's depth (``queue``, where the caller has it), and what the run has counted: prompts
    dropped by failed jobs, groups dropped by dynamic sampling, prompts skipped as settled, the tool calls that
    failed."""
    def number(key: str, spec: str) -> str:
        return "-" if line.get(key) is None else format(line[key], spec)

    loss = line.get("loss")
    # (GRPO's loss is often a few 1e-5: four decimals would show 0.0000, or -0.0000)
    loss_text = "-" if loss is None else format(loss + 0.0, ".4f" if loss == 0 or abs(loss) >= 1e-3 else ".2e")

    wait = line.get("trainer_wait_s")
    return (f"step={line['step']} reward={number('reward', '.3f')} staleness={number('staleness_mean', '.1f')} "
            f"wait_ms={'-' if wait is None else format(wait * 1e3, '.0f')} loss={loss_text}"
            + (f" queue={queue}" if queue else "")
            + (f" dropped_prompts={dropped_prompts}" if dropped_prompts else "")
            + (f" groups_dropped={line['groups_dropped']} groups_dropped_total={line['groups_dropped_total']}"
               if line.get("groups_dropped_total") else "")
            + (f" prompts_skipped={line['prompts_skipped']}" if line.get("prompts_skipped") else "")
            + (f" tool_failures={line['tool_failure_rate']:.0%}" if line.get("tool_failure_rate") is not None
               else ""))


def learning_note(line: dict | None) -> str | None:
    """What a metrics line says of steps that teach nothing, in one phrase; None when they do not last."""
    if not line:
        return None
    if line.get("steps_without_reward"):
        return (f"the last {line['steps_without_reward']} step(s) had no reward: every reward function returned "
                "None (or NaN) for every completion")
    if (line.get("steps_without_spread") or 0) >= NO_SPREAD_WARN_STEPS:
        return (f"for {line['steps_without_spread']} steps every group's completions scored alike: the advantages "
                "are all 0 and nothing is learned (the task learned already? else the reward, the model, or "
                "--dynamic_sampling?)")
    return None


@dataclass(frozen=True)
class StepMetrics:
    """One line: a logged optimizer step. Its fields, in this order, are the line's keys."""

    step: int
    reward: float | None
    reward_std: float | None
    loss: float | None
    grad_norm: float | None  # TRL's (transformers'), before clipping
    staleness_mean: float  # over the step's groups: step - 1 - the weights version of each group's result
    staleness_max: int
    # Over the step's completion tokens: step - 1 - the version that sampled each token (with in-flight updates
    # newer than its result's weights_version; without, staleness_mean weighted by tokens).
    token_staleness_mean: float
    weights_version: int  # the newest weights version among the step's results
    trainer_wait_s: float  # the step's wait for results
    groups_dropped: int  # by dynamic sampling, in this step
    groups_dropped_total: int  # by dynamic sampling, over the steps in the file
    prompts_skipped: int  # by the difficulty filter, so far
    tool_failure_rate: float | None  # TRL's, averaged over the step's results
    frac_reward_zero_std: float | None  # TRL's: the share of groups whose completions all scored alike
    steps_without_reward: int  # in a row, up to this step: every reward function returned None (ps/learning_signal.py)
    steps_without_spread: int  # in a row: every group's completions scored alike (advantages all 0)
    step_time_s: float  # since the previous line
    queue_depth: dict[str, int]  # JobQueue.counts() when the step was logged
    time: float  # wall clock, time.time()
    # Every metric TRL (and transformers) logged for the step, under its names: rewards/{function}/mean and /std,
    # kl, entropy, completions/mean_length, learning_rate, ... (asyncgrpo's own are the fields above)
    trl: dict = dataclasses.field(default_factory=dict)


def eval_line(step: int, logs: dict) -> dict:
    """The line of an evaluation at ``step``: TRL's ``eval_*`` metrics, as logged."""
    return {"step": step, "kind": "eval", **{k: v for k, v in logs.items() if k.startswith("eval_")},
            "time": time.time()}


@dataclass(frozen=True)
class Truncation:
    """What ``truncate_after`` did."""

    kept: list[dict]  # the lines kept, read
    removed: int  # lines of later steps removed
    unreadable: int  # unreadable lines removed


def append(path: str | os.PathLike, record: StepMetrics | dict) -> None:
    """Appends ``record`` (a step's, or an evaluation's ``eval_line``) as one line, in one write
    (fileops.append_line); an error names the file."""
    fileops.append_line(path, json.dumps(dataclasses.asdict(record) if isinstance(record, StepMetrics) else record))


def read_lines(path: str | os.PathLike, kind: str = "train") -> list[dict]:
    """Every readable line of ``kind`` ("train": the steps'; "eval"), oldest first; [] when the file is missing or
    cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    return [record for line in text.splitlines() if (record := _read(line, kind)) is not None]


def read_new_lines(path: str | os.PathLike, offset: int) -> tuple[list[dict], int]:
    """The readable lines appended since byte ``offset`` (0 at first, then what the previous call returned), and
    the offset to go on from: a line not yet ended by its newline (being written) is read whole next time."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            appended = f.read()
    except FileNotFoundError:
        return [], offset
    complete = appended[: appended.rfind(b"\n") + 1]
    return [record for line in complete.splitlines() if (record := _read(line, "train")) is not None], \
        offset + len(complete)


def last_line(path: str | os.PathLike) -> dict | None:
    """The newest readable line of a training step, read from the file's last TAIL_BYTES (the file grows with
    every step); None when there is none there."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            tail = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(tail):  # the tail's first line is usually cut; the last may be being written
        if (record := _read(line, "train")) is not None:
            return record
    return None


def truncate_after(path: str | os.PathLike, step: int) -> Truncation:
    """Keeps the lines of steps up to ``step``; lines of later steps and unreadable ones are removed. The file
    is rewritten (replaced atomically) only when something is removed."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
    except FileNotFoundError:
        return Truncation(kept=[], removed=0, unreadable=0)
    kept, kept_lines, unreadable = [], [], 0
    for line in lines:
        record = _read(line, None)
        if record is None:
            unreadable += 1
        elif record["step"] <= step:
            kept.append(record)
            kept_lines.append(line)
    if len(kept) < len(lines):
        fileops.replace_file(path, "".join(f"{line}\n" for line in kept_lines).encode())
    return Truncation(kept=kept, removed=len(lines) - len(kept) - unreadable, unreadable=unreadable)


def _read(line: str | bytes, kind: str | None) -> dict | None:
    """The line's record if it is readable and of ``kind`` (None: any)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step, (int, float)):
        return None
    return record if kind is None or record.get("kind", "train") == kind else None
