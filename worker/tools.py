"""The turns of a multi-turn rollout on a worker: each tool call bounded in time, and each turn timed.

TRL's tool loop (``GRPOTrainer._tool_call_loop``) alternates generation (``_generate_single_turn``) and
tool calls until no completion calls a tool or ``--max_tool_calling_iterations`` is reached. It handles a
tool that raises: the error's message becomes the tool's result, counted in ``tools/failure_frequency``.
It has no bound on a tool that never returns, and one such call would hold the worker, its job and,
through admission, the PS. ``RolloutTurns.bounding_tools`` wraps each of the batch's tools (TRL's
``_sync_tool_dicts`` / ``_async_tool_dicts``, built per batch, an environment's methods included) so that a
call still running after ``--tool_timeout_s`` raises ToolTimeout in the loop instead, which TRL handles as
any raised error. The call itself is abandoned: a Python thread cannot be killed, so a sync call runs in a
daemon thread left to finish or not (it does not keep the process alive); an async one is cancelled.
``bounding_environments`` puts an environment's ``reset()`` and ``get_reward()`` under the same bound: TRL has
no handling for those, so one past the bound fails the job, as one that raises does.

Every failed call (an error, a timeout, a name that is not among the tools: TRL answers that one itself, with
"Tool X not found.", which ``bounding_tools`` makes it do through a wrapper so that it is counted too) is
counted and logged with its text, rate-limited (``RepeatedFailureLog``); launch.sh shows these ``[tools]`` lines on
the terminal.

``RolloutTurns.timed`` records each generate call and the tool phase between two of them: events
``generate_turn_end`` and ``tools_end`` per turn (installed by worker/trl_seam.py), which ``queue_tools report``
turns into a job's split between generation, tool calls and reward.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from dataclasses import dataclass, field

from asyncgrpo.events import EventLog
from asyncgrpo.messages import RepeatedFailureLog, first_line
from worker.deadline import ACTIVITY
from worker.trl_seam import ENVIRONMENT_POOL

log = logging.getLogger("asyncgrpo.worker")



class ToolTimeout(TimeoutError):
    """A tool call ran past --tool_timeout_s; TRL makes its message the call's result."""


class WorkerStopping(Exception):
    """The worker was asked to stop (SIGTERM, Ctrl-C) while a tool call ran or was due: the call is cut, and the
    job's rollouts, cut with it, are not a result: the worker gives the job back (worker/loop.py)."""


STOPPING = threading.Event()  # set by the worker's stop request: tool calls in flight and due are cut at once
STOP_POLL_S = 0.1


class AbandonedCalls:
    """Sync tool calls cut by --tool_timeout_s whose threads still run: each holds a thread (and whatever it holds)
    until its call returns, which one that hangs for good never does. Said in a [tools] line as their number reaches
    each power of two from ``first_said`` on: the tool is what must change."""

    def __init__(self, first_said: int = 8):
        self.running, self._said_at, self._lock = 0, first_said, threading.Lock()

    def left(self, name: str) -> None:
        with self._lock:
            self.running += 1
            running, say = self.running, self.running >= self._said_at
            if say:
                self._said_at *= 2
        if say:
            log.warning("[tools] %d tool calls cut by --tool_timeout_s still run in this worker's threads (the last: "
                        "%s); a Python thread cannot be stopped: a tool that never returns leaks one a call, until the "
                        "worker restarts", running, name)

    def returned(self) -> None:
        with self._lock:
            self.running -= 1


ABANDONED = AbandonedCalls()


def call_within(timeout_s: float, name: str, function, *args, **kwargs):
    """``function(*args, **kwargs)``, or ToolTimeout once ``timeout_s`` have passed (0: no bound), or WorkerStopping
    once STOPPING is set. The call is left running in a daemon thread: a Python thread cannot be killed."""
    with ACTIVITY.doing("tool", name):  # what a job's deadline names (worker/deadline.py)
        return _call_within(timeout_s, name, function, *args, **kwargs)


def _call_within(timeout_s: float, name: str, function, *args, **kwargs):
    if STOPPING.is_set():
        raise WorkerStopping(f"{name}: not called, the worker is stopping")
    if not timeout_s:
        return function(*args, **kwargs)
    outcome: dict = {}
    done, lock = threading.Event(), threading.Lock()

    def call():
        try:
            outcome["value"] = function(*args, **kwargs)
        except BaseException as err:  # re-raised in the caller's thread
            outcome["error"] = err
        with lock:
            done.set()
            if outcome.get("abandoned"):
                ABANDONED.returned()

    threading.Thread(target=call, name=f"tool-{name}", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not done.wait(max(0.0, min(STOP_POLL_S, deadline - time.monotonic()))):
        if STOPPING.is_set():
            raise WorkerStopping(f"{name}: cut, the worker is stopping")
        if time.monotonic() >= deadline:
            with lock:
                abandoned = outcome["abandoned"] = not done.is_set()
            if abandoned:
                ABANDONED.left(name)
                raise ToolTimeout(f"{name}: no result within {timeout_s:g} s (--tool_timeout_s)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


async def await_within(timeout_s: float, name: str, awaitable):
    """The awaitable's result, or ToolTimeout once ``timeout_s`` have passed (0: no bound), or WorkerStopping once
    STOPPING is set; it is cancelled then."""
    with ACTIVITY.doing("tool", name):
        return await _await_within(timeout_s, name, awaitable)


async def _await_within(timeout_s: float, name: str, awaitable):
    if STOPPING.is_set():
        if asyncio.iscoroutine(awaitable):
            awaitable.close()  # never awaited: no "coroutine was never awaited" warning
        raise WorkerStopping(f"{name}: not called, the worker is stopping")
    if not timeout_s:
        return await awaitable
    task = asyncio.ensure_future(awaitable)
    deadline = time.monotonic() + timeout_s
    while True:
        done, _ = await asyncio.wait({task}, timeout=max(0.0, min(STOP_POLL_S, deadline - time.monotonic())))
        if done:
            return task.result()
        if STOPPING.is_set() or time.monotonic() >= deadline:
            task.cancel()
            if STOPPING.is_set():
                raise WorkerStopping(f"{name}: cut, the worker is stopping")
            raise ToolTimeout(f"{name}: no result within {timeout_s:g} s (--tool_timeout_s)")


def bounding_environments(trainer, timeout_s: float) -> None:
    """Each environment's ``reset()`` and ``get_reward()`` under the tools' bound, so that neither can hold the
    worker: past it ToolTimeout fails the job (thrown again, then reported), as an exception from them does.
    TRL keeps a pool of instances per environment (``_environment_pool``), reset for each batch, and makes more
    with ``environment_factories`` when a batch needs them: both are bounded here, once, when the trainer is built."""
    factories = getattr(trainer, "environment_factories", None)
    if not timeout_s or not factories:
        return

    def bounded_environment(factory):
        environment = factory()
        _bound_environment(environment, timeout_s)
        return environment

    for pool in getattr(trainer, ENVIRONMENT_POOL).values():
        for environment in pool:
            _bound_environment(environment, timeout_s)
    trainer.environment_factories = {name: functools.partial(bounded_environment, factory)
                                     for name, factory in factories.items()}


def _bound_environment(environment, timeout_s: float) -> None:
    """Instance attributes over the class's methods: TRL calls ``environment.reset(...)`` and
    ``environment.get_reward()`` on the instance, and lists tools from the class."""
    for method in ("reset", "get_reward"):
        function = getattr(environment, method, None)
        if function is None:
            continue
        name = f"{type(environment).__name__}.{method}()"
        if asyncio.iscoroutinefunction(function):
            async def bounded(*args, _function=function, _name=name, **kwargs):
                return await await_within(timeout_s, _name, _function(*args, **kwargs))
        else:
            def bounded(*args, _function=function, _name=name, **kwargs):
                return call_within(timeout_s, _name, _function, *args, **kwargs)
        setattr(environment, method, functools.wraps(function)(bounded))


TOOL_ERRORS = RepeatedFailureLog(log, "tools")  # the worker process's failed tool calls


def failure_kind(name: str, err: BaseException) -> str:
    if isinstance(err, ToolTimeout):
        return str(err)
    return f"{name}: {first_line(err)[:300]}"


class ToolsAnsweringAnyName(dict):
    """One row's sync tools, as TRL's loop looks a called name up (``name in sync``, then ``name in async``, else
    it raises "Tool X not found." itself, out of this module's sight). A name in neither is answered here, with
    a call that raises the same error, so that it is counted and logged with the name the model called."""

    def __init__(self, tools: dict, async_tools: dict, not_a_tool):
        super().__init__(tools)
        self.async_tools, self.not_a_tool = async_tools, not_a_tool

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, name) or name not in self.async_tools

    def __missing__(self, name):
        return self.not_a_tool(name)


@dataclass
class ToolTally:
    calls: int = 0
    failed: int = 0
    timed_out: int = 0
    busy_s: float = 0.0  # summed over calls

    def take(self) -> dict:
        out = {"calls": self.calls, "failed": self.failed, "timed_out": self.timed_out}
        self.calls = self.failed = self.timed_out = 0
        self.busy_s = 0.0
        return out


@dataclass
class RolloutTurns:
    """One job's turns: the tool bound, the tally of calls, and the events of each turn."""

    timeout_s: float
    events: EventLog
    job_fields: dict = field(default_factory=dict)
    tally: ToolTally = field(default_factory=ToolTally)
    turns: int = 0  # generate calls so far
    stopped: bool = False  # a tool call was cut because the worker is stopping (WorkerStopping)
    _last_turn_end: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # ------------------------------------------------------------------ tools

    def bounding_tools(self, sync_dicts: list[dict], async_dicts: list[dict] | None) -> None:
        """Wraps every tool of the current batch, in place: TRL's per-rollout dicts of sync and async tools (call
        after TRL built them, before its loop runs)."""
        async_dicts = async_dicts or [{}] * len(sync_dicts)
        for tools in async_dicts:
            for name, tool in tools.items():
                tools[name] = self._bounded_async(name, tool)
        known = sorted({name for tools in (*sync_dicts, *async_dicts) for name in tools})
        for i, (tools, async_tools) in enumerate(zip(sync_dicts, async_dicts, strict=True)):
            bounded = {name: self._bounded_sync(name, tool) for name, tool in tools.items()}
            sync_dicts[i] = ToolsAnsweringAnyName(bounded, async_tools, functools.partial(self._not_a_tool, known))

    def _not_a_tool(self, known: list[str], name: str):
        def not_a_tool(**_arguments):
            self._count(time.monotonic(), {"error": True})
            TOOL_ERRORS.failed(f"the model called {name!r}, which is not a tool of this run "
                               f"(its tools: {', '.join(known) or 'none'})")
            raise ValueError(f"Tool {name} not found.")  # TRL's own message for it

        return not_a_tool

    def _bounded_sync(self, name, tool):
        @functools.wraps(tool)  # TRL looks tools up by __name__
        def bounded(**arguments):
            with self._counted(name):
                return call_within(self.timeout_s, name, tool, **arguments)

        return bounded

    def _bounded_async(self, name, tool):
        @functools.wraps(tool)
        async def bounded(**arguments):
            with self._counted(name):
                return await await_within(self.timeout_s, name, tool(**arguments))

        return bounded

    @contextlib.contextmanager
    def _counted(self, name):
        """One tool call: counted, and a failure logged (rate-limited) before TRL's loop makes it the result."""
        started = time.monotonic()
        outcome: dict = {}
        try:
            yield
        except WorkerStopping:
            self.stopped = True
            raise
        except ToolTimeout as err:
            outcome["timeout"] = True
            TOOL_ERRORS.failed(failure_kind(name, err))
            raise
        except BaseException as err:  # handed to TRL's loop, which makes it the result
            outcome["error"] = True
            TOOL_ERRORS.failed(failure_kind(name, err))
            raise
        finally:
            self._count(started, outcome)

    def _count(self, started: float, outcome: dict) -> None:
        with self._lock:  # async tools finish on TRL's event-loop thread
            self.tally.calls += 1
            self.tally.failed += "error" in outcome or "timeout" in outcome
            self.tally.timed_out += "timeout" in outcome
            self.tally.busy_s += time.monotonic() - started

    # ------------------------------------------------------------------ turns

    def timed(self, generate_single_turn):
        """TRL's ``_generate_single_turn`` for one job's tool loop: each call is a turn; the time since the previous
        turn ended is that turn's tool phase."""

        @functools.wraps(generate_single_turn)
        def timed(prompt_ids, *args, **kwargs):
            started = time.monotonic()
            if self._last_turn_end is not None:  # the tools this generation follows
                self.events.emit("tools_end", turn=self.turns, dur_ms=(started - self._last_turn_end) * 1e3,
                                 **self.tally.take(), **self.job_fields)
            out = generate_single_turn(prompt_ids, *args, **kwargs)
            self._last_turn_end = time.monotonic()
            self.events.emit("generate_turn_end", turn=self.turns, rows=len(prompt_ids),
                             dur_ms=(self._last_turn_end - started) * 1e3, **self.job_fields)
            self.turns += 1
            return out

        return timed

    def finish(self) -> None:
        """The job's TRL call is over: repeated tool failures logged, and the tools after the last generation
        (every result overlong) counted."""
        TOOL_ERRORS.flush()
        if self.tally.calls:
            self.events.emit("tools_end", turn=self.turns, dur_ms=self.tally.busy_s * 1e3, **self.tally.take(),
                             **self.job_fields)
