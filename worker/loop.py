"""The worker loop: claim a job, sync weights, generate and score, write the result.

    python -m worker --device N --run_dir RUN [any config flag the PS got]

A worker holds its liveness lock and heartbeat for its whole life, recovers jobs an
earlier process left under its device number, waits for the PS's first weights, then
loops. SIGTERM or Ctrl-C: it finishes the job in hand (or releases it if it cannot) and
exits 0. When the PS goes away it keeps its weights and waits for a new one.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.inputs import load_model_and_tokenizer, load_reward_funcs, load_train_dataset, model_path
from asyncgrpo.jobqueue import JobQueue, JobState, QueueWatcher, QueueWriteError, RunDir, WorkerPresence
from asyncgrpo.weights import make_subscriber
from worker.generate import build_trainer, generate_and_score

log = logging.getLogger("asyncgrpo.worker")
IDLE_WAIT_S = 1.0  # how often an idle worker looks for weights or a stop request without an event


def run_worker(cfg: AsyncGRPOConfig, run: RunDir, device: int) -> int:
    stop = threading.Event()
    presence = WorkerPresence(run, device).start()
    watcher = QueueWatcher(run.queue, {JobState.PENDING}, use_events=not cfg.poll_only)

    def request_stop(signum, _frame):
        log.info("[worker] dev%d got signal %d: finishing the job in hand, then exiting", device, signum)
        stop.set()
        watcher.wake()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    queue = JobQueue(run)
    for action in queue.recover(lease_s=cfg.lease_s, max_attempts=cfg.max_attempts, own_device=device):
        log.info("[queue] dev%d recovered its own leftover: %s", device, action.line())

    trainer = _wait_and_build_trainer(cfg, run, stop, watcher)
    subscriber = make_subscriber(run)
    version = None
    try:
        while not stop.is_set():
            if version is None:  # never claim a job before holding the PS's weights
                version = _sync(subscriber, trainer.model, device)
                if version is None:
                    watcher.wait(IDLE_WAIT_S)
                continue
            job = queue.claim(device)
            if job is None:
                presence.update(state="idle", job_id=None)
                watcher.wait()
                continue
            presence.update(state="busy", job_id=job.job_id)
            version = _sync(subscriber, trainer.model, device) or version
            while version < job.data["min_weights_version"] and not stop.is_set():
                time.sleep(0.005)  # synchronous mode: only the newest weights may generate this job
                version = _sync(subscriber, trainer.model, device) or version
            if stop.is_set() and version < job.data["min_weights_version"]:
                queue.release(job)
                break
            presence.update(weights_version=version)
            _process(queue, job, trainer, version, device)
    finally:
        watcher.close()
        subscriber.close()
        presence.stop()
    log.info("[worker] dev%d stopped", device)
    return 0


def _wait_and_build_trainer(cfg, run, stop, watcher):
    path = model_path(cfg, run.root)
    while not (run.root / "ps.json").exists() and not stop.is_set():
        watcher.wait(IDLE_WAIT_S)  # the PS writes the demo model (and ps.json) before anything else
    model, tokenizer = load_model_and_tokenizer(path)
    cfg.output_dir = str(run.logs)  # a worker saves nothing, but TRL would create ./trainer_output
    return build_trainer(cfg, model, tokenizer, load_reward_funcs(cfg), load_train_dataset(cfg))


def _sync(subscriber, model, device) -> int | None:
    start = time.perf_counter()
    version = subscriber.sync(model)
    if version is not None:
        log.info("[weights] dev%d synced version=%d sync_ms=%.1f", device, version, (time.perf_counter() - start) * 1e3)
    return version


def _process(queue: JobQueue, job, trainer, version: int, device: int) -> None:
    started = time.time()
    try:
        batch, metrics = generate_and_score(trainer, job.data["rows"])
    except Exception as err:  # a bad prompt or reward function must not kill the worker
        log.exception("[gen] dev%d job %s failed", device, job.job_id)
        queue.fail(job, f"{type(err).__name__}: {err}")
        return
    done = time.time()
    try:
        published = queue.complete(
            job, {"batch": batch, "metrics": metrics, "rows": job.data["rows"]}, weights_version=version,
            queue_time=job.claimed_at - job.payload["created_at"], processing_time=done - started,
            job_age=done - job.payload["created_at"])
    except QueueWriteError as err:
        log.error("[queue] dev%d cannot write the result of %s: %s; giving the job back", device, job.job_id, err)
        queue.release(job)
        return
    log.info("[gen] dev%d job=%s weights_version=%d dur_ms=%.0f reward=%.3f published=%s", device, job.job_id,
             version, (done - started) * 1e3, metrics.get("reward", float("nan")), published)
