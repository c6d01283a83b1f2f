"""One-line messages for the operator: the first line of an error, a line logged once per process, and failures
that repeat, logged once each and then counted."""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
import warnings
from collections import Counter

_said: set[str] = set()


def first_line(err: BaseException, *, with_type: bool = True) -> str:
    """``"ValueError: <the first line of its message>"``; its type alone when the message is empty."""
    lines = str(err).strip().splitlines()
    if not lines:
        return type(err).__name__
    return f"{type(err).__name__}: {lines[0]}" if with_type else lines[0]


def log_once(logger: logging.Logger, msg: str, *args, key: str | None = None, level: int = logging.INFO) -> None:
    """Logs ``msg % args`` the first time this process meets ``key`` (default: the line itself): for what is a
    property of the run's setup, which every job would otherwise repeat."""
    key = key if key is not None else msg % args if args else msg
    if key not in _said:
        _said.add(key)
        logger.log(level, msg, *args)


class RepeatedFailureLog:
    """Failures that may repeat many times (a tool that raises on every call, a reward function that raises on
    some prompts), as WARNING lines tagged ``[tag]`` that launch.sh shows on the terminal: the first of each kind
    (its text) at once, the repeats counted and logged together every ``every_s`` seconds (checked at each failure
    and at each ``flush``). Past ``MAX_KINDS`` kinds (an error whose text names each prompt makes each failure a kind
    of its own), a new kind is counted as a repeat, not logged at once; the periodic line names the commonest.
    ``failed`` says whether it logged the kind at once, for a caller that adds what only the first of a kind needs
    (a failed job's traceback, worker/results.py)."""

    MAX_KINDS = 20
    NAMED_IN_A_LINE = 5

    def __init__(self, logger: logging.Logger, tag: str, every_s: float = 60.0, clock=time.monotonic):
        self.logger, self.tag, self.every_s, self.clock = logger, tag, every_s, clock
        self.seen: set[str] = set()
        self.repeats: Counter[str] = Counter()
        self.since = clock()
        self._lock = threading.Lock()  # async tools fail on TRL's event-loop thread

    def failed(self, kind: str) -> bool:
        """Counts one failure of ``kind``; True when it was the first of its kind, logged at once."""
        with self._lock:
            first = kind not in self.seen and len(self.seen) < self.MAX_KINDS
            if first:
                self.seen.add(kind)
                self.logger.warning("[%s] %s (the first such failure; repeats are counted and logged every %g s)",
                                    self.tag, kind, self.every_s)
            else:
                self.repeats[kind] += 1
        self.flush()
        return first

    def flush(self) -> None:
        """Logs the repeats counted since the last such line, if ``every_s`` has passed."""
        with self._lock:
            now = self.clock()
            if self.repeats and now - self.since >= self.every_s:
                named = self.repeats.most_common(self.NAMED_IN_A_LINE)
                others = sum(self.repeats.values()) - sum(n for _, n in named)
                self.logger.warning("[%s] failed again in the last %.0f s: %s%s", self.tag, now - self.since,
                                    "; ".join(f"{kind} (x{n})" for kind, n in named),
                                    f"; and {others} other failure(s) of {len(self.repeats) - len(named)} kind(s)"
                                    if others else "")
                self.repeats.clear()
            if not self.repeats:
                self.since = now


STOP_JOIN_S = 30.0


def join_or_report(thread: threading.Thread, what: str, logger: logging.Logger) -> None:
    """Joins a daemon thread that was asked to stop, for at most STOP_JOIN_S: a stop (Ctrl-C, the run's end) must
    end whatever that thread is stuck in. Past it, one line says so and every thread's stack goes to stderr (the
    process's log), and the thread is left to die with the process."""
    thread.join(STOP_JOIN_S)
    if thread.is_alive():
        logger.warning("%s did not stop within %g s: left running (a daemon thread); every thread's stack follows",
                       what, STOP_JOIN_S)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def quiet_library_deprecations() -> None:
    """Warnings one library gives of another's use of it, which no user can act on: off in the PS and the workers."""
    # TRL reads transformers' is_gradient_checkpointing and turns it off and on around generation (every worker's
    # job, the PS's evaluation), names transformers 5 deprecated.
    warnings.filterwarnings("ignore", message="`(is_gradient_checkpointing|gradient_checkpointing_(enable|disable))` "
                            "is deprecated", category=FutureWarning)
