"""The worker loop: claim a job, sync weights, generate and score, write the result.

    python -m worker --device N --run_dir RUN [any config flag the PS got]

A worker holds its liveness lock and heartbeat for its whole life, recovers jobs an
earlier process left under its device number, waits for the PS's first weights, then
loops. SIGTERM or Ctrl-C: it finishes the job in hand (or releases it if it cannot: a job whose
tool calls the stop cut short, worker/tools.py, is given back) and exits 0. When the PS goes
away it keeps its weights and waits for a new one.

A job whose generation or scoring raises goes back to the queue as its next attempt, the
error (type, message, which reward function) added to its payload; after ``max_attempts``
attempts it goes to the PS as a failure report (JobQueue.fail), and the PS decides whether the
run can go on. After a failure the worker waits before its next claim, longer after each
failure in a row (FAILURE_BACKOFF_S, doubling, at most FAILURE_BACKOFF_MAX_S), so a reward
function that always raises does not turn it into a loop of failures. The traceback of an
error is logged once per process; a repeat of it gets one line.

Unless the error says this process's GPU is broken (a CUDA error other than out-of-memory,
asyncgrpo/weights/device_errors.py): then every later job and weight sync would fail too,
so the worker logs one line and exits with EXIT_DEVICE_BROKEN; launch.sh starts a new
process (a new CUDA context), whose start-up recovery puts the job in hand back in the queue
with its attempt counted.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time

from asyncgrpo.config import AsyncGRPOConfig, ConfigError
from asyncgrpo.events import EventLog
from asyncgrpo.inputs import load_model_and_tokenizer, load_reward_funcs, load_train_dataset, model_path
from asyncgrpo.jobqueue import ClaimedJob, JobQueue, JobState, QueueWatcher
from asyncgrpo.jobqueue.handoff import JobData
from asyncgrpo.messages import first_line
from asyncgrpo.run import RunDir, WorkerPresence
from asyncgrpo.run.rundir import WorkerId
from asyncgrpo.supervisor import watch_supervisor
from asyncgrpo.user_code import load_rollout_hooks
from asyncgrpo.weights import make_subscriber
from asyncgrpo.weights.device_errors import is_broken_device_error
from worker import tools
from worker.continuous_loop import serve_continuously
from worker.deadline import JobDeadline
from worker.decoding import Decoder
from worker.decoding.build import build_decoder, resolve_mode
from worker.decoding.continuous import ContinuousDecoding
from worker.generate import JOB_FAILURES, JobInput, build_trainer, generate_jobs, job_seed
from worker.in_flight import InFlightWeights
from worker.in_flight import unsupported as in_flight_unsupported
from worker.results import Timing, fail, publish
from worker.trl_seam import GenerationPath, generation_path

log = logging.getLogger("asyncgrpo.worker")
IDLE_WAIT_S = 1.0  # how often an idle worker looks for weights or a stop request without an event
EXIT_DEVICE_BROKEN = 3  # exit status of a worker whose GPU failed; launch.sh restarts it
FAILURE_BACKOFF_S = 0.1  # wait after a failed job before the next claim, doubled for each failure in a row ...
FAILURE_BACKOFF_MAX_S = 1.0  # ... up to this
WORKER_WAIT_REPORT_S = 60.0  # how often a worker waiting (for weights, for the PS) says so in the log


class Waiting:
    """Says once every ``report_every_s`` what a worker waits for and since when. A worker keeps waiting (a stopped
    PS may go on, a new one may start), but not silently."""

    def __init__(self, device: WorkerId, report_every_s: float = WORKER_WAIT_REPORT_S):
        self.device, self.report_every_s = device, report_every_s
        self.what: str | None = None
        self.since = self.said = 0.0

    def waiting_for(self, what: str) -> None:
        now = time.monotonic()
        if what != self.what:
            self.what, self.since, self.said = what, now, now
        elif now - self.said >= self.report_every_s:
            self.said = now
            log.info("[worker] dev%s has waited %.0f s for %s", self.device, now - self.since, what)

    def over(self) -> None:
        self.what = None


class WorkerSetupError(RuntimeError):
    """Loading the model, the reward functions or TRL's trainer failed: the worker cannot start."""


class _StoppedWhileSettingUp(BaseException):  # (not an Exception: no fallback of the set-up may catch it)
    """A stop signal while the worker loads its model or compiles its decoding step: it holds no job yet, so it
    stops at once rather than after a compilation of up to minutes."""


def run_worker(cfg: AsyncGRPOConfig, run: RunDir, device: WorkerId) -> int:
    stop = threading.Event()
    setting_up = threading.Event()  # set while a stop signal interrupts at once
    presence = WorkerPresence(run, device, lease_s=cfg.lease_s).start()
    watcher = QueueWatcher(run.queue, {JobState.PENDING}, use_events=not cfg.poll_only)

    def request_stop(signum, _frame):
        stop.set()
        tools.STOPPING.set()
        watcher.wake()
        if setting_up.is_set():
            setting_up.clear()  # (a second signal, during the clean-up, only sets stop)
            raise _StoppedWhileSettingUp
        log.info("[worker] dev%s got signal %d: finishing the job in hand (giving it back if a tool call is "
                 "running: tool calls are cut now), then exiting", device, signum)

    tools.STOPPING.clear()  # (a worker run in a process that ran one before: tests)
    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # under nohup it stays ignored: the run goes on
        signal.signal(signal.SIGHUP, request_stop)  # its terminal closed: stop as on Ctrl-C (not die holding a job)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 PID: where each thread is, into the log
    # launch.sh or join.sh killed outright: SIGTERM. (ls tells workers nobody will stop from the others.)
    presence.update(supervisor_pid=watch_supervisor(f"worker dev{device}"))
    events = EventLog(run.logs, f"worker-dev{device}", "worker", _device_label(cfg))
    queue = JobQueue(run, events=events, max_payload_bytes=cfg.max_payload_bytes)
    deadline = JobDeadline(queue, cfg.job_timeout_s, cfg.max_attempts, events, device,
                           version=lambda: presence.get("weights_version"), stopping=stop.is_set,
                           stopped=presence.stop).start()
    for action in queue.recover(lease_s=cfg.lease_s, max_attempts=cfg.max_attempts, own_device=device):
        log.info("[queue] dev%s recovered its own leftover: %s", device, action.line())

    try:
        setting_up.set()
        trainer = _wait_and_build_trainer(cfg, run, stop, watcher, Waiting(device))
        if resolve_mode(cfg.worker_decoding, cfg.device_type) != "eager":
            presence.update(state="compiling")  # (the PS's waiting line says so: it may take a minute on a CPU)
        decoding = build_decoder(cfg, trainer, device, events)
        setting_up.clear()
        presence.update(state="idle")
    except (Exception, _StoppedWhileSettingUp) as err:
        setting_up.clear()
        watcher.close()
        deadline.stop()
        presence.stop()
        events.close()
        if isinstance(err, _StoppedWhileSettingUp):
            log.info("[worker] dev%s stopped by a signal while loading its model or compiling its decoding step "
                     "(it held no job)", device)
            return 0
        if isinstance(err, ConfigError) or is_broken_device_error(err):
            raise
        # Deterministic for this config and model (a library refusing a flag, a model that does not fit): a
        # restart would fail the same way, so this is bad input (exit 2), not a crash to restart.
        log.exception("[worker] dev%s could not build its model and trainer", device)
        raise WorkerSetupError(f"could not build its model and trainer: {first_line(err)} "
                               "(traceback in the worker's log)") from None
    # Multi-turn jobs (tools, a rollout function) are generated one by one: a second job claimed with the first
    # would only wait for it.
    jobs_per_call = 1 if generation_path(trainer) is GenerationPath.TURNS else cfg.jobs_per_generate
    subscriber = make_subscriber(run, on_read=presence.announce_read)
    in_flight = _in_flight_weights(cfg, trainer, subscriber, events, device)
    version = None
    status = 0
    failures_in_a_row = 0
    waiting = Waiting(device)
    try:
        while not stop.is_set():
            if version is None:  # never claim a job before holding the PS's weights
                version = _sync(subscriber, trainer.model, device, events)
                if version is None:
                    waiting.waiting_for("the parameter server's first weights")
                    watcher.wait(IDLE_WAIT_S)
                continue
            if isinstance(decoding, ContinuousDecoding):  # a loop of its own (worker/continuous_loop.py)
                serve_continuously(cfg, run, queue, trainer, decoding, subscriber, version, watcher, presence, stop,
                                   events, waiting)
                break
            job = queue.claim(device)
            if job is None:
                JOB_FAILURES.flush()  # (an idle worker's repeats too)
                presence.update(state="idle", job_id=None, job_ids=[])
                waiting.waiting_for("a job from the parameter server")
                watcher.wait()
                continue
            waiting.over()
            # The running PS's flags (a PS relaunched with other flags also trains the jobs it left in the queue).
            ps_flags = ps_status.generation if (ps_status := run.read_ps_status()) else None
            if mismatch := cfg.generation_mismatch(ps_flags):
                queue.release(job)  # for a worker started with the PS's flags
                raise ConfigError(mismatch)
            jobs = [job]
            while len(jobs) < jobs_per_call and (more := queue.claim(device)) is not None:
                jobs.append(more)  # only jobs already pending: a job in hand never waits for another
            jobs = _readable(cfg, queue, jobs, version, events)
            if not jobs:
                continue
            claimed = time.monotonic()
            presence.update(state="busy", job_id=job.job_id, job_ids=[j.job_id for j in jobs])
            for j in jobs:
                queue_wait_ms = (j.claimed_at - j.payload["created_at"]) * 1e3
                events.emit("job_claimed", job_id=j.job_id, attempt=j.attempt, queue_wait_ms=queue_wait_ms)
                log.info("[queue] dev%s claimed job=%s attempt=%d queue_wait_ms=%.0f", device, j.job_id, j.attempt,
                         queue_wait_ms)
            version = _newer(_sync(subscriber, trainer.model, device, events), version)
            needed = _version_floor(jobs, ps_status)
            if version < needed:
                waited_from = time.monotonic()
                while version < needed and not stop.is_set():
                    waiting.waiting_for(f"weights version {needed} (the job's floor: its step less --max_staleness)")
                    time.sleep(0.005)  # synchronous mode: only the newest weights may generate this job
                    version = _newer(_sync(subscriber, trainer.model, device, events), version)
                    needed = _version_floor(jobs, run.read_ps_status())  # (a PS relaunched meanwhile)
                events.emit("weights_wait", job_id=job.job_id, weights_version=version,
                            dur_ms=(time.monotonic() - waited_from) * 1e3)
            if stop.is_set() and version < needed:
                for j in jobs:
                    queue.release(j)
                    events.emit("job_released", job_id=j.job_id)
                break
            presence.update(weights_version=version)
            ok = _process(cfg, queue, jobs, trainer, version, events, claimed, decoding, in_flight)
            if in_flight is not None:  # the weights it synced between decoding steps are the model's now
                version = in_flight.version
            JOB_FAILURES.flush()  # repeats counted in the last minute, logged even once the failures stop
            if ok:
                failures_in_a_row = 0
            else:
                failures_in_a_row += 1
                presence.update(state="backoff", job_id=None, job_ids=[])
                stop.wait(min(FAILURE_BACKOFF_MAX_S, FAILURE_BACKOFF_S * 2 ** (failures_in_a_row - 1)))
            presence.update(recompiles=decoding.recompiles())
    except Exception as err:
        if not is_broken_device_error(err):
            raise
        log.error("[worker] dev%s exits (status %d): its GPU failed with %s; a new process gets a new CUDA "
                  "context", device, EXIT_DEVICE_BROKEN, first_line(err))
        status = EXIT_DEVICE_BROKEN
    finally:
        watcher.close()
        try:
            subscriber.close()  # frees IPC mappings: on a broken device that may fail too
        except Exception as err:
            log.warning("[weights] dev%s closing the weights reader: %s", device, first_line(err))
        deadline.stop()
        presence.stop()
        events.close()
    if status == 0:
        log.info("[worker] dev%s stopped", device)
    return status


def _wait_and_build_trainer(cfg, run, stop, watcher, waiting):
    path = model_path(cfg, run.root)
    while not run.ps_status_file.exists() and not stop.is_set():
        waiting.waiting_for("the parameter server to start (RUN/ps.json)")
        watcher.wait(IDLE_WAIT_S)  # the PS writes the demo model (and ps.json) before anything else
    # A training PS's flags, checked before anything loads (the claim checks them again: a PS may be relaunched).
    ps = run.read_ps_status()
    if ps is not None and ps.state == "training" and (mismatch := cfg.generation_mismatch(ps.generation)):
        raise ConfigError(mismatch)
    model, tokenizer = load_model_and_tokenizer(path, cfg)  # --dtype, --model_init_kwargs, ... as the PS
    cfg.output_dir = str(run.logs)  # a worker saves nothing, but TRL would create ./trainer_output
    return build_trainer(cfg, model, tokenizer, load_reward_funcs(cfg), load_train_dataset(cfg),
                         hooks=load_rollout_hooks(cfg))


def _device_label(cfg: AsyncGRPOConfig) -> str:
    if cfg.device_type == "cpu":
        return "cpu"
    return f"cuda:{os.environ.get('CUDA_VISIBLE_DEVICES', '0').split(',')[0]}"  # the physical GPU launch.sh chose


def _readable(cfg: AsyncGRPOConfig, queue: JobQueue, jobs: list[ClaimedJob], version: int,
              events: EventLog) -> list[ClaimedJob]:
    """The jobs whose data a worker can read (asyncgrpo/jobqueue/handoff.py), each with its ``job_data``; any
    other fails as a job whose generation raised would (thrown again, then reported to the PS)."""
    readable = []
    for job in jobs:
        try:
            job.job_data = JobData.from_dict(job.data)
        except ValueError as err:
            fail(cfg, queue, job, err, version, events)
            continue
        readable.append(job)
    return readable


def _in_flight_weights(cfg: AsyncGRPOConfig, trainer, subscriber, events: EventLog,
                       device: WorkerId) -> InFlightWeights | None:
    if not cfg.in_flight_updates:
        return None
    if (why := in_flight_unsupported(trainer)) is not None:
        log.info("[gen] dev%s --in_flight_updates: not with %s; new weights reach a job before it starts", device, why)
        return None
    return InFlightWeights(subscriber, trainer.model, events)


def _version_floor(jobs: list[ClaimedJob], ps_status) -> int:
    """The oldest weights version ``jobs`` may be generated with. A job thrown by an earlier PS of the run counts
    its floor in that PS's steps, which the running PS (relaunched without a checkpoint, or from an earlier one)
    may reach only by training on this very job: such a job takes the newest weights there are."""
    started = ps_status.started_at if ps_status is not None else float("-inf")
    return max((j.job_data.min_weights_version for j in jobs if j.payload["created_at"] >= started), default=0)


def _newer(synced: int | None, held: int) -> int:
    """The version the model holds after a sync that returned ``synced`` (None: nothing newer was published). A
    PS relaunched without a checkpoint publishes version 0 again: 0 is a version, not nothing."""
    return held if synced is None else synced


def _sync(subscriber, model, device: WorkerId, events: EventLog) -> int | None:
    start = time.monotonic()
    version = subscriber.sync(model)
    if version is not None:
        sync_ms = (time.monotonic() - start) * 1e3
        events.emit("weights_synced", weights_version=version, dur_ms=sync_ms, bytes=subscriber.synced_bytes)
        log.info("[weights] dev%s synced version=%d sync_ms=%.1f", device, version, sync_ms)
    return version


def _process(cfg: AsyncGRPOConfig, queue: JobQueue, jobs: list, trainer, version: int, events: EventLog,
             claimed: float, decoding: Decoder,
             in_flight: InFlightWeights | None = None) -> bool:
    """Generates and scores the jobs (in one generate call where that applies) and publishes each result; False if
    any of them raised (it is thrown again or reported failed). With ``in_flight``, newer weights are synced
    between decoding steps: each result's weights_version is its oldest token's."""
    started = time.time()
    inputs = [JobInput(job.job_data.rows, job_seed(trainer.args.seed, job.job_id), job.payload["created_step"],
                       {"job_id": job.job_id, "weights_version": version}) for job in jobs]
    # A bad prompt or reward function fails its job, not the worker (an error of a broken device is raised).
    if in_flight is not None:
        in_flight.version = version
    outcomes = generate_jobs(trainer, inputs, events, decoding, with_logs=cfg.log_completions, in_flight=in_flight)
    timing = Timing(claimed, started, time.time(), len(jobs), decoding.recompiles())
    published = [publish(cfg, queue, job, outcome, version, events, timing)
                 for job, outcome in zip(jobs, outcomes, strict=True)]
    return all(published)
