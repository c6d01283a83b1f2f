"""The worker's one loop (worker/loop.py ``_serve``) over any generation (worker/generation.py): what it claims and
when, the back-off after failed jobs, a stop; and synchronous mode (``--max_staleness 0``) through a real PS and
worker with each decoder: every job generated with the newest weights, continuous batching's too."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest
from helpers import RunProcesses, metrics, run_flags

from asyncgrpo.events import EventLog
from asyncgrpo.jobqueue.names import done_reason
from worker import loop
from worker.loop import FAILURE_BACKOFF_MAX_S, FAILURE_BACKOFF_S, Waiting, _serve

TIMEOUT_S = 600


class FailingGeneration:
    """A generation of one job a call whose every job fails; the stop comes with the ``calls``-th."""

    def __init__(self, stop: threading.Event, calls: int):
        self.stop, self.calls = stop, calls
        self.version, self.waiting, self.decoding = 3, Waiting(1), SimpleNamespace(recompiles=lambda: 0)
        self.trainer = None
        self.jobs, self.outcomes, self.submitted, self.failed = [], [], [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def wants_a_job(self):
        return not self.jobs

    def submit(self, job, floor):
        self.jobs.append(job)
        self.submitted.append(time.monotonic())

    def empty(self):
        return not self.jobs

    def job_ids(self):
        return [j.job_id for j in self.jobs]

    def sync(self):
        pass

    def give_back(self):
        self.jobs = []

    def published(self):
        done, self.outcomes = self.outcomes, []
        return done

    def check(self):
        pass

    def step(self):
        self.jobs = []
        self.outcomes.append(False)
        self.failed.append(time.monotonic())
        if len(self.failed) == self.calls:
            self.stop.set()


def test_after_each_failed_job_the_next_claim_waits_longer_whatever_the_generation(monkeypatch):
    """One loop for every decoder: the back-off is the loop's, so continuous batching has it too (its loop of its own
    claimed again at once)."""
    stop = threading.Event()
    generation = FailingGeneration(stop, calls=5)
    queue = SimpleNamespace(claim=lambda device: SimpleNamespace(job_id=f"{len(generation.submitted):06d}_000"))
    monkeypatch.setattr(loop, "_read_claimed", lambda cfg, run, queue, job, version, events, trainer: (job, 0))
    presence = SimpleNamespace(device=1, update=lambda **fields: None)
    watcher = SimpleNamespace(wait=lambda timeout=None: None)
    _serve(None, None, queue, generation, watcher, presence, stop, EventLog.off())
    assert len(generation.submitted) == 5
    pairs = zip(generation.failed[:-1], generation.submitted[1:], strict=True)  # a failure, the claim after it
    for k, (failed, next_claim) in enumerate(pairs, start=1):
        assert next_claim - failed >= min(FAILURE_BACKOFF_MAX_S, FAILURE_BACKOFF_S * 2 ** (k - 1)) - 1e-3, k


def test_the_heartbeat_names_a_claimed_job_before_the_generation_takes_it(monkeypatch):
    """Continuous batching prefills a job's prompt as it takes it: a long prompt on a CPU took longer than the lease,
    and recovery took the job back from the worker generating it (its heartbeat named no job, or another)."""
    stop = threading.Event()
    generation = FailingGeneration(stop, calls=2)
    named_at_submit = []
    presence_fields = {}
    submit = generation.submit

    def slow_submit(job, floor):  # (a prefill: what the heartbeat names meanwhile)
        named_at_submit.append(list(presence_fields.get("job_ids") or []))
        submit(job, floor)

    generation.submit = slow_submit
    queue = SimpleNamespace(claim=lambda device: SimpleNamespace(job_id=f"{len(generation.submitted):06d}_000"))
    monkeypatch.setattr(loop, "_read_claimed", lambda cfg, run, queue, job, version, events, trainer: (job, 0))
    monkeypatch.setattr(loop, "FAILURE_BACKOFF_S", 0.0)
    presence = SimpleNamespace(device=1, update=lambda **fields: presence_fields.update(fields))
    _serve(None, None, queue, generation, SimpleNamespace(wait=lambda timeout=None: None), presence, stop,
           EventLog.off())
    assert named_at_submit == [["000000_000"], ["000001_000"]]


@pytest.mark.process
@pytest.mark.parametrize("decoding", ["eager", "continuous"])
def test_synchronous_mode_generates_every_job_with_the_newest_weights_whatever_the_decoder(tmp_path, decoding):
    """--max_staleness 0: each job is generated with the weights of the step that takes it (a job whose floor is
    above the weights held waits for them: a batch before it starts, continuous batching's job outside the slots),
    and no result is thrown away as stale."""
    run_root = tmp_path / "run"
    with RunProcesses(run_root, "--max_staleness", "0", "--worker_decoding", decoding, *run_flags(6)) as run:
        run.ps()
        worker = run.worker(1)
        run.expect_ps_exit(0, TIMEOUT_S)
        assert run.stop([worker]) == [0]
    assert [(m["step"], m["staleness_max"]) for m in metrics(run_root)] == [(step, 0) for step in range(1, 7)]
    reasons = {done_reason(p.name).value for p in (run_root / "done").iterdir()}
    assert "stale" not in reasons, reasons


STOP_WHILE_THE_WATCHER_IS_LOCKED = """
import contextlib, os, signal, sys, threading
from pathlib import Path
from asyncgrpo.jobqueue import JobState, QueueWatcher
from worker.loop import _stop_on_signals

watcher = QueueWatcher(Path(sys.argv[1]), {JobState.PENDING}, use_events=False)
stop, setting_up = threading.Event(), threading.Event()
with contextlib.ExitStack() as teardown:
    _stop_on_signals(stop, setting_up, watcher, 1, teardown)
    with watcher._wake._cond:  # held by this thread, as Event.wait holds it once its wait ends
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs in this thread, between two of its bytecodes
        sum(range(1000))
    print("stopped" if stop.wait(10) else "not stopped")
"""


@pytest.mark.process
def test_a_stop_signal_while_the_main_thread_holds_the_watchers_lock_stops_the_worker(tmp_path):
    """A signal handler that set the watcher's Event itself waited forever for the lock its own thread held: the
    worker hung holding its job until launch.sh killed it (seen in a SIGHUP test). A real process: a hang is a
    timeout here, not a hung suite."""
    import subprocess
    import sys

    from helpers import REPO

    done = subprocess.run([sys.executable, "-c", STOP_WHILE_THE_WATCHER_IS_LOCKED, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout.strip() == "stopped", done.stderr[-2000:]


TWO_SIGNALS = """
import contextlib, logging, os, signal, sys, threading
from pathlib import Path
from asyncgrpo.jobqueue import JobState, QueueWatcher
from worker.loop import _stop_on_signals

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
watcher = QueueWatcher(Path(sys.argv[1]), {JobState.PENDING}, use_events=False)
stop, setting_up = threading.Event(), threading.Event()
with contextlib.ExitStack() as teardown:
    _stop_on_signals(stop, setting_up, watcher, 1, teardown)
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, from the terminal
    os.kill(os.getpid(), signal.SIGTERM)  # and launch.sh passing it on
    print("stopped" if stop.wait(10) else "not stopped")
"""


@pytest.mark.process
def test_ctrl_c_and_launch_sh_passing_it_on_make_one_stop_line(tmp_path):
    import subprocess
    import sys

    from helpers import REPO

    done = subprocess.run([sys.executable, "-c", TWO_SIGNALS, str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "stopped", done.stderr[-2000:]
    assert [line for line in done.stdout.splitlines() if "got signal" in line] == [
        "[worker] dev1 got signal 2: finishing the job in hand (giving it back if a tool call is running: tool calls "
        "are cut now), then exiting"], done.stdout


# --------------------------------------------------------------------------- the PS's flags at a claim

@pytest.mark.process  # (a dead pid: a process started and ended)
def test_a_claim_is_refused_for_the_flags_of_a_running_ps_only(run, queue, tmp_path, monkeypatch):
    """A worker whose generation flags differ from the running PS's gives the job back and stops (ConfigError). An
    interrupted PS's ps.json says it trains until the relaunched PS writes its own: its jobs, left in the queue, are
    claimed meanwhile. Its flags are not the run's when its pid is dead, or when another PS has since taken the run's
    lock (it writes itself into ps.lock at once: readable from any host)."""
    from helpers import dead_pid, demo_config

    from asyncgrpo.config import ConfigError
    from asyncgrpo.run import liveness
    from asyncgrpo.run.rundir import PSStatus

    mine = demo_config(tmp_path, temperature=0.7)
    theirs = PSStatus.starting("model", None, demo_config(tmp_path, temperature=1.0).generation_settings())
    queue.put_job("000001_000", {}, created_step=1)

    def claim():
        return loop._read_claimed(mine, run, queue, queue.claim(1), 0, EventLog.off())

    run.write_ps_status(theirs)  # (this process: alive)
    with pytest.raises(ConfigError, match=r"^this worker's flags are not the parameter server's: --temperature 0.7"):
        claim()
    assert queue.counts()["pending"] == 1  # given back, no attempt used
    run.write_ps_status(PSStatus(**{**vars(theirs), "pid": dead_pid()}))
    assert claim() is None  # (its data is no job's: failed as a bad job fails, not refused)
    queue.put_job("000002_000", {}, created_step=2)
    run.write_ps_status(theirs)
    run.ps_lock_file.write_text("pid 4242 on another-host")  # a relaunched PS, its ps.json not written yet
    assert claim() is None
    queue.put_job("000003_000", {}, created_step=3)
    # One relaunched in a new container: the pid and hostname of the one before (this process's), not its host id.
    monkeypatch.setattr(liveness, "HOST_ID", "a-new-container")
    liveness.PSRunLock(run).release()
    assert claim() is None


@pytest.mark.process  # (waits out a heartbeat that does not move)
def test_a_claim_goes_by_the_heartbeat_of_a_ps_on_another_host(run, queue, tmp_path):
    """A PS on another host: its pid means nothing here, and an interrupted one's status still names it in ps.lock
    until the relaunched PS takes the lock (a Slurm job's nodes start together). Its flags are the run's while its
    heartbeat moves, not once it stands still."""
    from helpers import demo_config

    from asyncgrpo.config import ConfigError
    from asyncgrpo.run.liveness import PS_SILENT_S, PSHeartbeat
    from asyncgrpo.run.rundir import PSStatus

    mine = demo_config(tmp_path, temperature=0.7)
    theirs = PSStatus(**{**vars(PSStatus.starting("model", None,
                                                  demo_config(tmp_path, temperature=1.0).generation_settings())),
                         "pid": 4242, "host": "another-host", "host_id": "another-host/0000/0000"})
    run.write_ps_status(theirs)
    run.ps_lock_file.write_text("pid 4242 on another-host\nhost id another-host/0000/0000")
    run.ps_heartbeat_file.touch()
    queue.put_job("000001_000", {}, created_step=1)
    queue.put_job("000002_000", {}, created_step=2)

    def claim():
        return loop._read_claimed(mine, run, queue, queue.claim(1), 0, EventLog.off())

    with PSHeartbeat(run, interval_s=0.2):
        with pytest.raises(ConfigError, match=r"^this worker's flags are not the parameter server's"):
            claim()
    assert queue.counts()["pending"] == 2  # given back
    last_beat = time.time() - PS_SILENT_S
    os.utime(run.ps_heartbeat_file, (last_beat, last_beat))  # an interrupted PS's last beat, 10 s ago
    assert claim() is None  # the job's (bad) data decides, as for a dead PS here


def test_a_heartbeat_that_stands_still_is_a_ps_that_stopped_once_it_is_old(run):
    """A heartbeat that does not move is the PS's only once it is PS_SILENT_S old: a PS that died a second ago has a
    young one, and a PS whose heartbeat lags for a second (a slow write, a filesystem's cached attributes) is not
    taken for a stopped one."""
    from asyncgrpo.run.liveness import PSHeartbeat, ps_heartbeat_moves

    assert not ps_heartbeat_moves(run, silent_s=0.5)  # never beat
    run.ps_heartbeat_file.touch()
    started = time.monotonic()
    assert not ps_heartbeat_moves(run, silent_s=0.5)
    assert time.monotonic() - started >= 0.4  # (waited for it to age, not judged by one look)
    with PSHeartbeat(run, interval_s=0.1):
        assert ps_heartbeat_moves(run, silent_s=5)


def test_a_flag_given_on_one_side_only_is_said_not_given(tmp_path):
    from helpers import demo_config

    ps = demo_config(tmp_path, worker_dtype="bfloat16").generation_settings()
    assert demo_config(tmp_path).generation_mismatch(ps) == (
        "this worker's flags are not the parameter server's: --worker_dtype not given (the parameter server's: "
        "'bfloat16'); start it with the parameter server's config flags")
    assert demo_config(tmp_path, worker_dtype="bfloat16").generation_mismatch(
        demo_config(tmp_path).generation_settings()).startswith(
        "this worker's flags are not the parameter server's: --worker_dtype 'bfloat16' (the parameter server's: not "
        "given)")
