"""Shared fixtures: a fresh run directory and a queue over it, in pytest's tmp_path; one
real 8-step demo run (a PS and two workers) that several tests read. Shared helpers
(processes, back-dated mtimes, the exactly-once check) are in tests/helpers/."""

import contextlib
import logging
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

# Each process of a parallel run (pytest-xdist: scripts/test.sh) takes its share of the cores: torch's threads spin
# while they wait, and threads outnumbering the cores slow every process of the machine down several times over.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from helpers import DEMO_RUN_FLAGS, expect_exit, start_process, start_zygote

from asyncgrpo import messages
from asyncgrpo.jobqueue import JobQueue
from asyncgrpo.run import RunDir, fileops


@pytest.fixture
def run(tmp_path) -> RunDir:
    return RunDir.create(tmp_path / "run")


@pytest.fixture
def queue(run) -> JobQueue:
    return JobQueue(run)


@pytest.fixture(autouse=True)
def _queue_logs_visible(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="asyncgrpo")
    monkeypatch.setattr(messages, "_said", set())  # what a process logs once, each test sees logged


# Tests send Ctrl-C (SIGINT) to processes they start. Started from a background shell job
# (nohup ... &), pytest inherits SIGINT ignored, and an ignored signal stays ignored across
# exec in every child: give the children the default disposition back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def finished_demo_run(tmp_path_factory) -> Path:
    """The run directory of a real PS + 2 workers run of 8 steps, finished and stopped (workers
    exit 0 on SIGTERM). Started once per test process (in a parallel run, by each process that runs a test of it);
    tests only read it (the report adds report/).
    The processes' output is in the parent folder: ps.log, w1.log, w2.log."""
    root = tmp_path_factory.mktemp("demo8") / "run"
    ps = start_process(root, root.parent / "ps.log", "ps", *DEMO_RUN_FLAGS)
    workers = [start_process(root, root.parent / f"w{i}.log", "worker", "--device", str(i), *DEMO_RUN_FLAGS)
               for i in (1, 2)]
    try:
        expect_exit(ps, 0, root.parent / "ps.log", 600)
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        codes = [worker.wait(timeout=120) for worker in workers]
    assert codes == [0, 0], codes
    return root


def _left_behind(basetemp: Path, since: float) -> list[str]:
    """Weight buffer folders in /dev/shm of runs under ``basetemp``, and torchrun folders in the temp folder made
    since ``since``: what a process of the suite left behind. However a PS ends, its buffers must go."""
    found = []
    for folder in Path("/dev/shm").glob("asyncgrpo-weights-*"):
        owner = fileops.read_json(folder / "owner.json") or {}
        if str(owner.get("run", "")).startswith(str(basetemp) + os.sep):
            found.append(f"{folder} (run {owner['run']})")
    for folder in Path(tempfile.gettempdir()).glob("torchelastic_*"):
        with contextlib.suppress(OSError):
            if folder.stat().st_mtime >= since:
                found.append(str(folder))
    return found


def _logging_errors(basetemp: Path) -> list[str]:
    """The process logs under ``basetemp`` in which the logging module reported an error: a log call whose
    arguments do not fit its format prints a traceback in place of its line (an operator would read a traceback
    where the line should be), and the process goes on."""
    return [str(path) for path in basetemp.rglob("*") if path.suffix in (".log", ".txt") and path.is_file()
            and "--- Logging error ---" in path.read_text(errors="replace")]


_STARTED = pytest.StashKey[float]()


def pytest_sessionstart(session):
    session.config.stash[_STARTED] = time.time()


_PROBLEMS = pytest.StashKey[list[str]]()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """Fails the suite, after its last test, where its processes left something behind or logged a line that could
    not be formatted (listed at the end of the summary). In a parallel run the process that ran no test checks, once
    every other has ended: one that ended first would take another's live run for a leftover."""
    if hasattr(session.config, "workerinput"):  # (a pytest-xdist worker)
        return
    basetemp = session.config._tmp_path_factory.getbasetemp().resolve()
    problems = [f"left behind by the suite's processes: {what}"
                for what in _left_behind(basetemp, session.config.stash[_STARTED])]
    problems += [f"a logging error (a line that could not be formatted) in {log}" for log in _logging_errors(basetemp)]
    session.config.stash[_PROBLEMS] = problems
    if problems and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    if problems := config.stash.get(_PROBLEMS, []):
        terminalreporter.section("the suite's end checks", red=True)
        for problem in problems:
            terminalreporter.line(f"ERROR: {problem}", red=True)


# The fast tier (`bash scripts/test.sh --fast`: pytest -m "not process and not slow") runs what starts no process and
# compiles nothing. In every run of the suite, a test without the `process` mark that does either, in its body or in
# a fixture it uses, fails naming what it started, so the tier stays what it says (a test that broke the rule would
# otherwise pass in the full suite, and only the fast tier would see it).
# Helper processes a library starts for itself are let through: matplotlib's first import on a machine runs fc-list
# to build its font cache.
LIBRARY_HELPERS = {"fc-list", "fc-match"}


def _program(args, kwargs) -> str:
    argv = args[0] if args else kwargs.get("args")
    first = argv if isinstance(argv, (str, bytes, os.PathLike)) else (argv[0] if argv else "")
    return os.path.basename(os.fsdecode(first).split()[0]) if first else ""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if item.get_closest_marker("process") is not None or item.get_closest_marker("slow") is not None:
        start_zygote()  # before any launch.sh: it forks its processes from the zygote once it runs
        yield
        return
    saved = subprocess.Popen.__init__, torch.compile

    def refuse(what, original=None):
        def refused(*args, **kwargs):
            if original is not None and _program(args[1:], kwargs) in LIBRARY_HELPERS:
                return original(*args, **kwargs)
            pytest.fail(f"{what} in a test without @pytest.mark.process: mark it, or it slows the fast tier")
        return refused

    subprocess.Popen.__init__ = refuse("starts a process (subprocess.Popen)", saved[0])
    torch.compile = refuse("compiles (torch.compile)")
    try:
        yield
    finally:
        subprocess.Popen.__init__, torch.compile = saved


def pytest_collection_modifyitems(items):
    for item in items:  # whole runs, every one of them
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.process)
    # The whole runs first (each file's tests kept together, in order): in a parallel run the longest files are then
    # handed out first, and the short ones even the processes' ends out.
    items.sort(key=lambda item: "e2e" not in item.path.parts)
