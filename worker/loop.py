"""The worker loop: claim jobs, hand them to the generation, write the results.

    python -m worker --device N --run_dir RUN [any config flag the PS got]

A worker holds its liveness lock and heartbeat for its whole life, recovers jobs an
earlier process left under its device number, builds its model and decoder, waits for the PS's
first weights, then loops: it claims while its generation (worker/generation.py: the jobs of
one decoder call, or continuous batching's slots) takes jobs, checks each one, and lets it
generate. SIGTERM or Ctrl-C: it claims nothing more, finishes the jobs in hand (or gives them
back if it cannot: a job not started yet, or whose tool calls the stop cut short,
worker/tools.py) and exits 0; during its set-up, when it holds no job, at once. When the PS goes
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

import contextlib
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
from asyncgrpo.run.liveness import ps_may_run
from asyncgrpo.run.rundir import WorkerId
from asyncgrpo.supervisor import watch_supervisor
from asyncgrpo.user_code import load_rollout_hooks
from asyncgrpo.weights import make_subscriber
from asyncgrpo.weights.device_errors import is_broken_device_error
from worker import tools
from worker.deadline import JobDeadline
from worker.decoding import Decoder
from worker.decoding.build import build_decoder, compiles
from worker.decoding.continuous import ContinuousDecoding
from worker.generate import JOB_FAILURES, build_trainer
from worker.generation import BatchGeneration, EngineGeneration, sync_weights, version_floor
from worker.in_flight import InFlightWeights
from worker.in_flight import unsupported as in_flight_unsupported
from worker.results import fail
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
    with contextlib.ExitStack() as teardown:  # (closed in reverse, however the worker ends)
        presence = WorkerPresence(run, device, lease_s=cfg.lease_s).start()
        teardown.callback(presence.stop)
        watcher = QueueWatcher(run.queue, {JobState.PENDING}, use_events=not cfg.poll_only)
        teardown.callback(watcher.close)
        _stop_on_signals(stop, setting_up, watcher, device, teardown)
        # launch.sh or join.sh killed outright: SIGTERM. (ls tells workers nobody will stop from the others.)
        presence.update(supervisor_pid=watch_supervisor(f"worker dev{device}"))
        events = EventLog(run.logs, f"worker-dev{device}", "worker", _device_label(cfg))
        teardown.callback(events.close)
        queue = JobQueue(run, events=events, max_payload_bytes=cfg.max_payload_bytes)
        deadline = JobDeadline(queue, cfg.job_timeout_s, cfg.max_attempts, events, device,
                               version=lambda: presence.get("weights_version"), stopping=stop.is_set,
                               stopped=presence.stop).start()
        teardown.callback(deadline.stop)
        queue.recover(lease_s=cfg.lease_s, max_attempts=cfg.max_attempts, own_device=device)  # (it logs each move)
        try:
            trainer, decoding = _set_up(cfg, run, device, stop, setting_up, watcher, presence, events)
        except _StoppedWhileSettingUp:
            log.info("[worker] dev%s stopped by a signal while loading its model or compiling its decoding step "
                     "(it held no job)", device)
            return 0
        subscriber = make_subscriber(run, on_read=presence.announce_read, on_bad_delta=presence.announce_bad_delta)
        teardown.callback(_close_reader, subscriber, device)
        try:
            generation = _generation(cfg, run, queue, trainer, decoding, subscriber, events, presence, stop)
            _serve(cfg, run, queue, generation, watcher, presence, stop, events)
        except Exception as err:
            if not is_broken_device_error(err):
                raise
            log.error("[worker] dev%s exits (status %d): its GPU failed with %s; a new process gets a new CUDA "
                      "context", device, EXIT_DEVICE_BROKEN, first_line(err))
            return EXIT_DEVICE_BROKEN
    log.info("[worker] dev%s stopped", device)
    return 0


def _stop_on_signals(stop: threading.Event, setting_up: threading.Event, watcher: QueueWatcher,
                     device: WorkerId, teardown: contextlib.ExitStack) -> None:
    """SIGTERM, SIGINT (Ctrl-C) and SIGHUP (its terminal closed; ignored under nohup) stop the worker: it claims
    nothing more and finishes the jobs in hand, or, while it sets up, stops at once (_StoppedWhileSettingUp).
    SIGUSR1 writes every thread's stack into its log.

    A handler runs in the main thread between two of its bytecodes, possibly while that thread holds the lock of
    an Event it waits on (the watcher's, as its wait times out): setting that Event from the handler would wait for
    the lock forever, the worker hung holding its job. So the handler only writes to a pipe, and a thread of its
    own sets the events."""
    read_end, write_end = os.pipe()
    signals_seen: list[int] = []

    def relay_stops():
        while os.read(read_end, 1):
            stop.set()
            tools.STOPPING.set()
            watcher.wake()
        os.close(read_end)

    def request_stop(signum, _frame):
        with contextlib.suppress(OSError):  # (after the teardown: the worker is ending anyway)
            os.write(write_end, b"s")
        if setting_up.is_set():
            setting_up.clear()  # (a second signal, during the clean-up, only stops)
            raise _StoppedWhileSettingUp
        if signals_seen:  # (Ctrl-C reaches the worker and launch.sh passes it on: one line)
            return
        signals_seen.append(signum)
        log.info("[worker] dev%s got signal %d: finishing the job in hand (giving it back if a tool call is "
                 "running: tool calls are cut now), then exiting", device, signum)

    tools.STOPPING.clear()  # (a worker run in a process that ran one before: tests)
    threading.Thread(target=relay_stops, name="stop-signals", daemon=True).start()
    teardown.callback(os.close, write_end)  # (the thread ends)
    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # under nohup it stays ignored: the run goes on
        signal.signal(signal.SIGHUP, request_stop)  # its terminal closed: stop as on Ctrl-C (not die holding a job)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 PID: where each thread is, into the log


def _set_up(cfg: AsyncGRPOConfig, run: RunDir, device: WorkerId, stop: threading.Event,
            setting_up: threading.Event, watcher: QueueWatcher, presence: WorkerPresence, events: EventLog):
    """The model, TRL's trainer and the decoder (compiled where it is), once the PS has started; a stop signal
    meanwhile raises _StoppedWhileSettingUp. A failure that a restart would repeat is WorkerSetupError."""
    setting_up.set()
    try:
        trainer = _wait_and_build_trainer(cfg, run, stop, watcher, Waiting(device))
        if compiles(cfg):
            presence.update(state="compiling")  # (the PS's waiting line says so: it may take a minute on a CPU)
        decoding = build_decoder(cfg, trainer, device, events)
    except Exception as err:
        if isinstance(err, ConfigError) or is_broken_device_error(err):
            raise
        # Deterministic for this config and model (a library refusing a flag, a model that does not fit): a
        # restart would fail the same way, so this is bad input (exit 2), not a crash to restart.
        log.exception("[worker] dev%s could not build its model and trainer", device)
        raise WorkerSetupError(f"could not build its model and trainer: {first_line(err)} "
                               "(traceback in the worker's log)") from None
    finally:
        setting_up.clear()
    presence.update(state="idle")
    return trainer, decoding


def _close_reader(subscriber, device: WorkerId) -> None:
    try:
        subscriber.close()  # frees IPC mappings: on a broken device that may fail too
    except Exception as err:
        log.warning("[weights] dev%s closing the weights reader: %s", device, first_line(err))


def _serve(cfg: AsyncGRPOConfig, run: RunDir, queue: JobQueue, generation: BatchGeneration | EngineGeneration,
           watcher: QueueWatcher, presence: WorkerPresence, stop: threading.Event, events: EventLog) -> None:
    """The loop: claim while the generation takes jobs, hand them over, let it generate; after a failed job, wait
    before the next claim (longer after each in a row). Returns after a stop, the jobs in hand done or given
    back."""
    device, waiting = presence.device, generation.waiting
    while generation.version is None:  # never claim a job before holding the PS's weights
        if stop.is_set():
            return
        generation.version = sync_weights(generation.subscriber, generation.trainer.model, device, events)
        if generation.version is None:
            waiting.waiting_for("the parameter server's first weights")
            watcher.wait(IDLE_WAIT_S)
    failures_in_a_row, claim_after = 0, 0.0
    with generation:
        while True:
            generation.check()
            for written in generation.published():
                failures_in_a_row = 0 if written else failures_in_a_row + 1
                if not written:
                    claim_after = time.monotonic() + min(FAILURE_BACKOFF_MAX_S,
                                                         FAILURE_BACKOFF_S * 2 ** (failures_in_a_row - 1))
            JOB_FAILURES.flush()  # repeats counted in the last minute, logged even once the failures stop
            backing_off = time.monotonic() < claim_after
            while not stop.is_set() and not backing_off and generation.wants_a_job():
                job = queue.claim(device)  # only jobs already pending: a job in hand never waits for another
                if job is None:
                    break
                # Said before the hand-over: a long prompt's prefill inside ``submit`` may outlast the lease, and
                # recovery takes back a job that the heartbeat does not name.
                held = [*generation.job_ids(), job.job_id]
                presence.update(state="busy", job_ids=held, job_id=held[0])
                if (claimed := _read_claimed(cfg, run, queue, job, generation.version, events,
                                             generation.trainer)) is not None:
                    generation.submit(*claimed)
            if stop.is_set():
                generation.give_back()  # the jobs not started yet, for a worker that goes on
            job_ids = generation.job_ids()
            presence.update(state="busy" if job_ids else "backoff" if backing_off else "idle", job_ids=job_ids,
                            job_id=job_ids[0] if job_ids else None, weights_version=generation.version,
                            recompiles=generation.decoding.recompiles())
            if generation.empty():
                generation.sync()  # the next job starts with the newest weights
                if stop.is_set():
                    return
                if backing_off:
                    stop.wait(claim_after - time.monotonic())
                else:
                    waiting.waiting_for("a job from the parameter server")
                    watcher.wait(IDLE_WAIT_S)
                continue
            waiting.over()
            generation.step()


def _generation(cfg: AsyncGRPOConfig, run: RunDir, queue: JobQueue, trainer, decoding: Decoder, subscriber,
                events: EventLog, presence: WorkerPresence, stop: threading.Event):
    device = presence.device
    if isinstance(decoding, ContinuousDecoding):
        return EngineGeneration(cfg, queue, trainer, decoding, subscriber, events, presence, stop, Waiting(device))
    # Multi-turn jobs (tools, a rollout function) are generated one by one: a second job claimed with the first
    # would only wait for it.
    jobs_per_call = 1 if generation_path(trainer) is GenerationPath.TURNS else cfg.jobs_per_generate
    in_flight = _in_flight_weights(cfg, trainer, subscriber, events, device)
    return BatchGeneration(cfg, run, queue, trainer, decoding, subscriber, events, presence, stop, Waiting(device),
                           in_flight, jobs_per_call)


def _read_claimed(cfg: AsyncGRPOConfig, run: RunDir, queue: JobQueue, job: ClaimedJob, version: int,
                  events: EventLog, trainer=None) -> tuple[ClaimedJob, int] | None:
    """A claimed job, said and checked: the running PS's flags must be this worker's (ConfigError, the job given
    back: a PS relaunched with other flags also trains the jobs it left in the queue), and its data readable
    (asyncgrpo/jobqueue/handoff.py; else it fails as a job whose generation raised would). The job, with its
    ``job_data``, and its weights floor; None when it failed."""
    device = job.name.device
    queue_wait_ms = (job.claimed_at - job.payload["created_at"]) * 1e3
    events.emit("job_claimed", job_id=job.job_id, attempt=job.attempt, queue_wait_ms=queue_wait_ms)
    log.info("[queue] dev%s claimed job=%s attempt=%d queue_wait_ms=%.0f", device, job.job_id, job.attempt,
             queue_wait_ms)
    ps_status = run.read_ps_status()
    if ps_status and (mismatch := cfg.generation_mismatch(ps_status.generation)) and ps_may_run(run, ps_status):
        queue.release(job)  # for a worker started with the PS's flags
        raise ConfigError(mismatch)
    if trainer is not None:  # (a PS relaunched for a run of another length)
        _set_run_length(trainer, cfg, ps_status)
    try:
        job.job_data = JobData.from_dict(job.data)
    except ValueError as err:
        fail(cfg, queue, job, err, version, events)
        return None
    return job, version_floor([job], ps_status)


def _wait_and_build_trainer(cfg, run, stop, watcher, waiting):
    path = model_path(cfg, run.root)
    while not run.ps_status_file.exists() and not stop.is_set():
        waiting.waiting_for("the parameter server to start (RUN/ps.json)")
        watcher.wait(IDLE_WAIT_S)  # the PS writes the demo model (and ps.json) before anything else
    # A training PS's flags, checked before anything loads (the claim checks them again: a PS may be relaunched).
    ps = run.read_ps_status()
    if ps and ps.state == "training" and (mismatch := cfg.generation_mismatch(ps.generation)) and ps_may_run(run, ps):
        raise ConfigError(mismatch)
    model, tokenizer = load_model_and_tokenizer(path, cfg, cfg.worker_dtype)  # as the PS, unless --worker_dtype
    cfg.output_dir = str(run.logs)  # a worker saves nothing, but TRL would create ./trainer_output
    trainer = build_trainer(cfg, model, tokenizer, load_reward_funcs(cfg), load_train_dataset(cfg),
                            hooks=load_rollout_hooks(cfg))
    _set_run_length(trainer, cfg, ps)
    return trainer


def _set_run_length(trainer, cfg: AsyncGRPOConfig, ps) -> None:
    """What a reward reads of the run in TRL's trainer_state beside the job's step (worker/generate.py), which
    transformers sets only when it trains (max_steps 0: a schedule by global_step / max_steps divided by 0): the
    run's --max_steps, or where it is -1 (a run by epochs) the training PS's count of its steps (ps.json's)."""
    last = cfg.max_steps if cfg.max_steps > 0 else ps.max_steps if ps and ps.state == "training" else None
    if last and last != trainer.state.max_steps:
        trainer.state.max_steps = last
        trainer.state.compute_steps(trainer.args, last)


def _device_label(cfg: AsyncGRPOConfig) -> str:
    if cfg.device_type == "cpu":
        return "cpu"
    return f"cuda:{os.environ.get('CUDA_VISIBLE_DEVICES', '0').split(',')[0]}"  # the physical GPU launch.sh chose


def _in_flight_weights(cfg: AsyncGRPOConfig, trainer, subscriber, events: EventLog,
                       device: WorkerId) -> InFlightWeights | None:
    if not cfg.in_flight_updates:
        return None
    if (why := in_flight_unsupported(trainer)) is not None:
        log.info("[gen] dev%s --in_flight_updates: not with %s; new weights reach a job before it starts", device, why)
        return None
    return InFlightWeights(subscriber, trainer.model, events)
