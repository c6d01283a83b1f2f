"""What a job and its result carry between the PS and a worker: the ``data`` inside the queue's files.

The queue (queue.py) owns each file's envelope (schema, kind, job id, attempt, times, weights version) and
its moves; this module owns what the envelope carries (and, in ``read_result_payload``, how a result's data
agrees with its envelope's weights version):

- ``JobData``: written by the PS's producer, read by a worker. The job's dataset rows (one generation
  batch, each prompt repeated ``num_generations`` times) and the oldest weights it may be generated with.
- ``ResultData``: written by a worker, read by the PS. TRL's generate-and-score output for those rows
  (``batch``: ids, masks, advantages, and the behaviour log-probs where sent), each completion's reward
  before TRL normalises it, the job's TRL metrics, its rows, and with ``--log_completions`` the rows of
  TRL's completions table.
- ``FailureReport``: written by the queue for a job given up after its last attempt (``JobQueue.fail``):
  the error of each attempt (``error_record`` keys, ``describe_error``) and the job's data.

A file holds plain dicts and tensors (a payload is loaded with ``torch.load(weights_only=True)``, which
takes no classes of ours): each record is written with ``to_dict`` and read back with ``from_dict``, which
checks it and raises ValueError naming what is wrong. ``HANDOFF_VERSION`` is written into each; data without
it is version 1 (what asyncgrpo wrote before the key existed). torch is imported only where a batch is
checked, so the operator's tools stay light.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HANDOFF_VERSION = 1
VERSION_KEY = "handoff"

# A result's batch: TRL's _generate_and_score_completions output, by the shape of each tensor.
PER_SEQUENCE = ("advantages",)
PER_PROMPT_TOKEN = ("prompt_ids", "prompt_mask")
PER_COMPLETION_TOKEN = ("completion_ids", "completion_mask")
BEHAVIOUR_KEY = "old_per_token_logps"  # optional: absent when the worker generated with the newest weights
# Per completion, the weighted sum of its rewards that TRL normalises into advantages (NaN where no reward
# function scored it); dynamic sampling reads each group's spread from it (ps/groups.py). Travels in the batch.
REWARDS_KEY = "rewards"

# One attempt's error, as a worker describes it (worker/generate.py error_record) and the queue keeps it.
ERROR_KEYS = ("type", "message", "stage", "reward_function", "traceback", "time", "attempt", "worker_device",
              "weights_version")


def _check_version(data: dict, what: str) -> None:
    version = data.get(VERSION_KEY, 1)
    if version != HANDOFF_VERSION:
        raise ValueError(f"{what} was written by another asyncgrpo (handoff version {str(version)[:20]!r}; this "
                         f"one reads {HANDOFF_VERSION})")


def _check_rows(rows, what: str) -> None:
    if not isinstance(rows, list) or not rows or not all(isinstance(row, dict) for row in rows):
        raise ValueError(f"{what}'s rows must be a non-empty list of dicts")


@dataclass
class JobData:
    rows: list[dict]
    min_weights_version: int  # synchronous mode (max_staleness 0) needs the newest weights; otherwise 0

    def to_dict(self) -> dict:
        return {VERSION_KEY: HANDOFF_VERSION, "rows": self.rows, "min_weights_version": self.min_weights_version}

    @classmethod
    def from_dict(cls, data) -> JobData:
        if not isinstance(data, dict):
            raise ValueError("a job's data must be a dict")
        _check_version(data, "the job")
        _check_rows(data.get("rows"), "a job")
        floor = data.get("min_weights_version")
        if type(floor) is not int or floor < 0:
            raise ValueError(f"a job's min_weights_version {str(floor)[:40]!r} is not a non-negative integer")
        return cls(data["rows"], floor)


@dataclass
class ResultData:
    batch: dict  # tensor name -> tensor, on the CPU; REWARDS_KEY not among them
    rewards: object | None  # torch.Tensor (completions,), float; None from a worker that did not send it
    metrics: dict[str, float]
    rows: list[dict]
    logs: dict | None = None  # TRL's completions table rows (worker/generate.py completion_logs)
    # With in-flight updates (worker/in_flight.py, worker/decoding/continuous.py): the weights versions that sampled
    # each row's tokens, as runs [(first_token, version), ...] a row, token t of the row sampled by the last run
    # starting at or before t. None: every token by the result's weights_version.
    token_versions: list[list[tuple[int, int]]] | None = None

    @property
    def completions(self) -> int:
        return self.batch["advantages"].size(0)

    def to_dict(self) -> dict:
        batch = dict(self.batch) if self.rewards is None else {**self.batch, REWARDS_KEY: self.rewards}
        data = {VERSION_KEY: HANDOFF_VERSION, "batch": batch, "metrics": self.metrics, "rows": self.rows}
        if self.logs is not None:
            data["logs"] = self.logs
        if self.token_versions is not None:
            data["token_versions"] = [[list(run) for run in runs] for runs in self.token_versions]
        return data

    def tokens_by_version(self, rows: list[int], weights_version: int) -> dict[int, int]:
        """How many completion tokens of ``rows`` each weights version sampled."""
        lengths = self.batch["completion_mask"][rows].sum(dim=1).tolist()
        counts: dict[int, int] = {}
        for row, length in zip(rows, lengths, strict=True):
            runs = self.token_versions[row] if self.token_versions else [(0, weights_version)]
            for i, (first, version) in enumerate(runs):
                end = runs[i + 1][0] if i + 1 < len(runs) else length
                if (n := int(min(end, length) - first)) > 0:
                    counts[version] = counts.get(version, 0) + n
        return counts

    @property
    def oldest_version(self) -> int | None:
        """The version of its oldest token, where ``token_versions`` says."""
        return oldest_version(self.token_versions) if self.token_versions else None

    @classmethod
    def from_dict(cls, data, rows_per_job: int) -> ResultData:
        """The result in ``data``, checked to hold the keys and shapes the trainer needs."""
        import torch  # here: the operator's tools import this module without torch

        if not isinstance(data, dict) or not isinstance(data.get("batch"), dict) or "rows" not in data:
            raise ValueError("result data must hold 'batch', 'metrics' and 'rows'")
        _check_version(data, "the result")
        if not isinstance(data.get("metrics", {}), dict):
            raise ValueError("result data's 'metrics' must be a dict")
        if not isinstance(data.get("logs", {}), dict):
            raise ValueError("result data's 'logs' (the completions table rows) must be a dict")
        batch = dict(data["batch"])
        rewards = batch.pop(REWARDS_KEY, None)
        for key in PER_SEQUENCE + PER_PROMPT_TOKEN + PER_COMPLETION_TOKEN:
            if not isinstance(batch.get(key), torch.Tensor):
                raise ValueError(f"batch[{key!r}] is missing or not a tensor")
        n = batch["advantages"].shape[0]
        if n != rows_per_job or batch["advantages"].dim() != 1:
            raise ValueError(f"advantages has shape {tuple(batch['advantages'].shape)}, expected ({rows_per_job},)")
        if rewards is not None and (not isinstance(rewards, torch.Tensor) or tuple(rewards.shape) != (n,)
                                    or not rewards.is_floating_point()):
            raise ValueError(f"batch[{REWARDS_KEY!r}] must be a float tensor of shape ({n},)")
        if BEHAVIOUR_KEY in batch and not isinstance(batch[BEHAVIOUR_KEY], torch.Tensor):
            raise ValueError(f"batch[{BEHAVIOUR_KEY!r}] is not a tensor")
        completion_keys = PER_COMPLETION_TOKEN + ((BEHAVIOUR_KEY,) if BEHAVIOUR_KEY in batch else ())
        for group in (PER_PROMPT_TOKEN, completion_keys):
            shapes = {tuple(batch[key].shape) for key in group}
            if len(shapes) != 1 or next(iter(shapes))[0] != n or len(next(iter(shapes))) != 2:
                raise ValueError(f"inconsistent shapes for {group}: {[tuple(batch[k].shape) for k in group]}")
        for key in ("prompt_ids", "completion_ids"):  # (a job of empty prompts only: TRL pads nothing into floats)
            if batch[key].is_floating_point() or batch[key].is_complex():
                raise ValueError(f"batch[{key!r}] holds {batch[key].dtype}, not token ids")
        if n and int(batch["prompt_mask"].sum(dim=1).min()) < 1:
            raise ValueError("a row has no prompt token (an empty prompt?)")
        _check_rows(data["rows"], "a result")
        versions = data.get("token_versions")
        if versions is not None:
            if not isinstance(versions, list) or len(versions) != n:
                raise ValueError(f"a result's token_versions must hold one list of runs a row, {n} of them")
            versions = [_checked_runs(runs) for runs in versions]
        return cls(batch, rewards, data.get("metrics", {}), data["rows"], data.get("logs"), versions)


def oldest_version(token_versions: list[list[tuple[int, int]]]) -> int:
    """The version that sampled the oldest of a result's tokens (the one the staleness bound goes by): the oldest of
    its rows' first runs."""
    return min(runs[0][1] for runs in token_versions)


def _checked_runs(runs) -> list[tuple[int, int]]:
    """A row's token versions: [[0, version], [first_token, version], ...], non-negative integers, first tokens
    increasing (ValueError otherwise)."""
    well_formed = isinstance(runs, list) and runs and all(
        isinstance(run, (list, tuple)) and len(run) == 2 and all(type(x) is int and x >= 0 for x in run)
        for run in runs)
    firsts = [run[0] for run in runs] if well_formed else []
    if not well_formed or firsts[0] != 0 or firsts != sorted(set(firsts)):
        raise ValueError("a result's token_versions must be runs [[0, version], [first_token, version], ...] of "
                         "non-negative integers, first tokens increasing, one list a row")
    return [tuple(run) for run in runs]


@dataclass
class FailureReport:
    errors: list[dict]  # one per attempt, oldest first (ERROR_KEYS)
    job: dict = field(default_factory=dict)  # the job's data (JobData.to_dict), for its rows

    def to_dict(self) -> dict:
        return {VERSION_KEY: HANDOFF_VERSION, "errors": self.errors, "job": self.job}

    @classmethod
    def from_dict(cls, data) -> FailureReport:
        _check_version(data, "the failure report")
        errors, job = data["errors"], data.get("job")
        if not isinstance(errors, list) or not errors or not all(isinstance(e, dict) for e in errors):
            raise ValueError("a failure report's errors must be a non-empty list of dicts")
        if not isinstance(job, dict) or not isinstance(job.get("rows"), list):
            raise ValueError("a failure report must hold the job's data with its rows")
        return cls(errors, job)


def read_result(data, rows_per_job: int) -> ResultData | FailureReport:
    """A result file's data, checked (ValueError otherwise): a generated batch, or a failure report."""
    if isinstance(data, dict) and "errors" in data:
        return FailureReport.from_dict(data)
    return ResultData.from_dict(data, rows_per_job)


def read_result_payload(payload: dict, rows_per_job: int) -> None:
    """Checks a collected result file's payload (ValueError otherwise) and puts its data in typed form: a
    ResultData, or a FailureReport for a job given up after its last attempt. Besides ``read_result``'s checks of
    the data: the envelope's weights_version, and that the result's oldest token was sampled by it."""
    version = payload["weights_version"]
    if type(version) is not int or version < 0:
        raise ValueError(f"weights_version {str(version)[:40]!r} is not a non-negative integer")
    data = read_result(payload["data"], rows_per_job)
    oldest = getattr(data, "oldest_version", None)
    if oldest is not None and oldest != version:  # the oldest token's version is the one the staleness bound goes by
        raise ValueError(f"token_versions start at version {oldest}, the result's weights_version is {version}")
    payload["data"] = data


def describe_error(error: dict) -> str:
    """One line for one of a job's errors: "reward function 'f' raised ValueError: ..." (or "generation
    raised ..."; for a job past its deadline, its message, which names where it was stuck). An error holds
    ERROR_KEYS: ``type``, ``message``, ``stage`` ("generation" or "scoring"), ``reward_function`` (None outside
    one), ``traceback``, ``time``, and the ``attempt``, ``worker_device`` and ``weights_version`` it failed on."""
    lines = str(error.get("message", "")).strip().splitlines() or [""]
    message = lines[0][:300] + (" ..." if len(lines) > 1 or len(lines[0]) > 300 else "")
    if error.get("type") == "JobTimeout":  # (worker/deadline.py: its message says where it was stuck)
        return message
    where = f"reward function {error['reward_function']!r}" if error.get("reward_function") else error.get("stage")
    return f"{where or 'the job'} raised {error.get('type', 'an exception')}: {message}"
