"""Timeline events: what each process did and when, one JSON line per event.

Every process appends to its own ``RUN/logs/events-{process}.jsonl`` (``ps``,
``worker-dev1``, ...; a relaunched process appends to the same file with a new pid).
``queue_tools report`` reads them back. Each line holds:

    event    the name (table below)
    t        wall clock, seconds since the epoch (time.time())
    mono     monotonic clock, seconds (time.monotonic(): one clock for all processes of a host)
    pid, process, role ("ps" | "worker"), device ("cpu", "cuda:1", ...)
    job_id, weights_version   where they apply

An event with ``dur_ms`` closes a span that began ``dur_ms`` before its ``mono``.

    role    event              fields
    ps      job_created        job_id, weights_version (the job's minimum), rows, created_step (just before
                               its file appears in queue/)
    ps      result_collected   job_id, weights_version, worker_device, latency_ms (result written -> collected)
    ps      wait_result        step, dur_ms: the trainer waited for a result for this step
    ps      result_consumed    job_id, weights_version, step (the first it trains), staleness, token_staleness
                               ({staleness: completion tokens}), samples, tokens,
                               groups, of_groups: the result's groups in that step's batch (with dynamic
                               sampling a result may give groups to two batches, and a batch take from several)
    ps      groups_dropped     job_id, groups, reward_std, reason: dynamic sampling dropped them
    any     result_archived    job_id, reason, attempt: any job or result file moved to done/; record: true for
                               a record of part of a result written into done/ (JobQueue.archive_record)
    ps      result_rolled_back job_id: a result consumed after the checkpoint a relaunched PS resumes from, out of
                               done/ and back in the queue, to be trained again (or archived otherwise)
    ps      train_step_start   step
    ps      train_step_end     step, dur_ms, wait_ms, staleness (the step's stalest result) (reward and loss per
                               step: RUN/metrics.jsonl)
    ps      weights_published  weights_version, dur_ms, bytes (written: safetensors' anchor or delta)
    ps      eval_start/_end    step; dur_ms: TRL's evaluation (--eval_strategy), on the PS's model
    ps      job_dropped        job_id, attempt, prompts, error: a job given up after its last attempt (archived
                               failed; error None when it was orphaned), its prompts never trained on
    ps      job_straggling     job_id, held_s, worker: a worker has held the job far longer than jobs take;
                               admission no longer waits for it (ps/producer.py)
    worker  job_claimed        job_id, attempt, queue_wait_ms (created -> claimed)
    worker  weights_synced     weights_version, dur_ms, bytes; in_flight: a sync between decoding steps
                               (--in_flight_updates, continuous batching), at_token: the token it came before
                               (--in_flight_updates)
    worker  weights_wait       job_id, weights_version, dur_ms (synchronous mode: waited for newer weights)
    worker  decoding_compiled  dur_ms, graphs, rows, mode: the decoding step compiled before the first job
                               (worker/decoding/build.py)
    worker  generate_start     job_id, weights_version; jobs_in_call: the jobs sharing its generate call
                               (--jobs_per_generate), each with its own event
    worker  generate_end       job_id, weights_version, dur_ms; jobs_in_call as above
    worker  generate_turn_end  job_id, weights_version, turn, rows, dur_ms: one generate call of a multi-turn job
                               (tools: worker/tools.py), inside its generate span
    worker  tools_end          job_id, weights_version, turn, calls, failed, timed_out, dur_ms: the tool calls
                               before that turn (since the previous turn's end)
    worker  score_start        job_id, weights_version
    worker  score_end          job_id, weights_version, dur_ms (rewards, advantages, behaviour log-probs)
    worker  result_written     job_id, weights_version, dur_ms (claimed -> written), published, samples, tokens,
                               jobs_in_call, recompiles (the decoding's graphs compiled after its warm-up so far)
    worker  job_failed         job_id, attempt, error (one line), given_up (its last attempt: reported to the PS)
    worker  job_released       job_id

Reading them back: ``read_events(run_root, process=..., role=..., event=...)``, the one reader every tool,
benchmark and test uses (queue_tools/timeline.py builds the report's per-process tracks on it).

Appending never blocks the hot path for long: one ``write`` of one line to a file opened
with O_APPEND (atomic per line, so threads share the descriptor). A failed write (full
disk) drops events with one warning; it never stops training or generation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Collection
from pathlib import Path

log = logging.getLogger("asyncgrpo.events")


class EventLog:
    def __init__(self, logs_dir: str | os.PathLike | None, process: str, role: str, device: str):
        self.path = Path(logs_dir) / f"events-{process}.jsonl" if logs_dir is not None else None
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666) if self.path else None
        self._common = {"pid": os.getpid(), "process": process, "role": role, "device": device}
        self._write_failed = False
        self._torn = False  # a write was cut short: the file ends inside a line

    @classmethod
    def off(cls) -> EventLog:
        """An event log that records nothing (tests and tools that are not part of a run)."""
        return cls(None, "none", "none", "none")

    def emit(self, event: str, **fields) -> None:
        if self._fd is None:
            return
        record = {"event": event, "t": time.time(), "mono": time.monotonic(), **self._common, **fields}
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        if self._torn:  # the last line was cut short: end it, so that this one stays whole and readable
            line = b"\n" + line
        try:
            written = os.write(self._fd, line)
        except OSError as err:
            written, error = 0, err
        else:
            error = None if written == len(line) else OSError(f"wrote {written} of {len(line)} bytes (disk full?)")
        if error is None:
            self._write_failed = self._torn = False
            return
        self._torn = self._torn or written > 0
        if not self._write_failed:
            self._write_failed = True
            log.warning("[events] cannot append to %s (%s); events are dropped until it works again", self.path, error)

    @contextlib.contextmanager
    def span(self, name: str, **fields):
        """Emits ``{name}_start``, runs the block, emits ``{name}_end`` with ``dur_ms``.

        The block may add fields to the end event through the dict it receives."""
        self.emit(f"{name}_start", **fields)
        end_fields = dict(fields)
        started = time.monotonic()
        try:
            yield end_fields
        finally:
            self.emit(f"{name}_end", dur_ms=(time.monotonic() - started) * 1e3, **end_fields)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ----------------------------------------------------------------------------- reading them back

def event_files(run_root: str | os.PathLike, process: str | None = None) -> list[Path]:
    """``RUN/logs/events-*.jsonl`` in name order (``ps`` before ``worker-dev1``...), or only ``process``'s file;
    [] when there is none (or no logs folder)."""
    return sorted((Path(run_root) / "logs").glob(f"events-{process or '*'}.jsonl"))


def read_event_file(path: str | os.PathLike) -> tuple[list[dict], int]:
    """(the file's events in file order, lines skipped). A line that is not a JSON object with a string ``event``
    and a finite numeric ``mono`` (a process killed mid-write leaves a torn last line; a full disk a torn line
    inside) is skipped and counted; a file removed meanwhile reads as empty."""
    events, skipped = [], 0
    try:
        with open(path, "rb") as f:
            for raw in f:
                if not raw.strip():
                    continue
                try:
                    event = json.loads(raw)
                except ValueError:  # (a torn multi-byte character is a UnicodeDecodeError, a ValueError)
                    event = None
                mono = event.get("mono") if isinstance(event, dict) else None
                if (isinstance(event, dict) and isinstance(event.get("event"), str) and isinstance(mono, (int, float))
                        and not isinstance(mono, bool) and math.isfinite(mono)):
                    events.append(event)
                else:
                    skipped += 1
    except FileNotFoundError:
        pass
    return events, skipped


def read_events(run_root: str | os.PathLike, *, process: str | None = None, role: str | None = None,
                event: str | Collection[str] | None = None) -> list[dict]:
    """The run's events, each file in file order, files in name order (``ps`` first; sort by ``mono`` for one
    timeline across processes). Lines that are not events are skipped (read_event_file); no logs folder: [].

    Filters, each None for all:
        process   one process's file: ``"ps"``, ``"worker-dev1"`` (its lives, relaunches included, in order)
        role      the events' ``role``: ``"ps"`` or ``"worker"`` (every worker process)
        event     an event name, or a collection of names
    """
    names = {event} if isinstance(event, str) else None if event is None else set(event)
    return [e for path in event_files(run_root, process) for e in read_event_file(path)[0]
            if (role is None or e.get("role") == role) and (names is None or e["event"] in names)]
