"""The parameter server's trainer: TRL's GRPOTrainer, fed from the job queue instead of generating.

The only TRL internal replaced is ``_generate_and_score_completions`` in training mode:
instead of generating, it takes the next result a worker produced with TRL's own code
(worker/generate.py), checks its staleness, marks it consumed and returns it. TRL's
``_prepare_inputs`` (splitting, buffering) and loss (clipped ratio against the worker's
``old_per_token_logps``) run unchanged. After each optimizer step the weights are
published, ``global_step.txt`` is written, and each logged step appends one line to
``RUN/metrics.jsonl``. Checkpoints carry the consumed-job ledger.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback
from trl import GRPOTrainer

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.events import EventLog
from asyncgrpo.jobqueue import ArchiveReason, JobQueue, JobState, RunDir, fileops
from asyncgrpo.jobqueue.names import done_name
from asyncgrpo.jobqueue.rundir import LEDGER_FILE, checkpoint_folders, newest_complete_checkpoint
from asyncgrpo.weights import make_publisher
from ps.collector import ResultCache, ResultCollector
from ps.producer import JobProducer

log = logging.getLogger("asyncgrpo.ps")
WAIT_REPORT_S = 30.0  # a trainer waiting this long for results says so in the log
ACTIVE = (JobState.PENDING, JobState.PROCESSING, JobState.COMMITTING, JobState.COMPLETE)


def last_complete_checkpoint(checkpoints: Path) -> str | None:
    """The checkpoint to resume from: the newest complete one. Newer folders without a ledger
    are saves the old PS was killed in: removed, never resumed from (one PS per run, so no
    save is in progress here)."""
    complete = newest_complete_checkpoint(checkpoints)
    for _, folder in checkpoint_folders(checkpoints):
        if folder == complete:
            break
        log.warning("[train] %s is incomplete (the PS died while saving it): removed", folder)
        shutil.rmtree(folder)
    return str(complete) if complete else None


def checkpoint_step(folder: str) -> int:
    with open(os.path.join(folder, LEDGER_FILE)) as f:
        return int(json.load(f)["global_step"])


class AsyncGRPOTrainer(GRPOTrainer):
    def __init__(self, cfg: AsyncGRPOConfig, run: RunDir, model, tokenizer, reward_funcs, dataset):
        super().__init__(model=model, reward_funcs=reward_funcs, args=cfg, train_dataset=dataset,
                         processing_class=tokenizer)
        self.cfg, self.run = cfg, run
        self.events = EventLog(run.logs, "ps", "ps", str(self.accelerator.device))
        self.queue = JobQueue(run, events=self.events)
        self.consumed: set[str] = set()
        self.cache = ResultCache()
        self.collector = ResultCollector(cfg, self.queue, self.cache)
        self.producer = JobProducer(cfg, self.queue, dataset, lambda: len(self.consumed),
                                    lambda: self.state.global_step)
        self.publisher = make_publisher(run, self.model, cfg.weight_transport)
        self._resume_checkpoint: str | None = None
        self._step_record = _new_step_record()  # since the last logged step
        self._step_started = self._last_step_end = time.monotonic()
        self._step_wait_s = 0.0  # this optimizer step's wait for results
        self.add_callback(_PipelineCallback(self))

    # ------------------------------------------------------------------ lifecycle

    def train(self, resume_from_checkpoint: str | None = None, **kwargs):
        self._resume_checkpoint = resume_from_checkpoint
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        finally:
            self._stop_pipeline()
            if sys.exc_info()[0] is not None:  # interrupted: finish() will not run to free /dev/shm
                self.publisher.close()

    def _start_pipeline(self) -> None:
        """Called once model, optimizer and step are restored: adopt the queue, then feed it."""
        if self._resume_checkpoint:
            with open(os.path.join(self._resume_checkpoint, LEDGER_FILE)) as f:
                self.consumed = set(json.load(f)["consumed"])
        self._readopt_rolled_back_results()
        self._publish_weights()
        readopted = self.collector.collect_now(readopt=True)
        if readopted:
            log.info("[queue] re-adopted %d result(s) from the run directory", readopted)
        self.collector.start()
        self.producer.start()

    def _stop_pipeline(self) -> None:
        for part in (self.producer, self.collector):
            if part.thread.is_alive():
                part.stop()

    def _readopt_rolled_back_results(self) -> None:
        """Results consumed after the checkpoint we resume from were trained into weights that
        were lost with the old PS: put them back in the queue to be trained on again."""
        for entry in fileops.scan(self.run.done):
            if not entry.name.endswith("_consumed.pt"):
                continue
            job_id = entry.name[: -len("_consumed.pt")]
            if job_id in self.consumed or entry.name != done_name(job_id, ArchiveReason.CONSUMED):
                continue
            collected = self.run.queue / f"{job_id}_collected.pt"
            try:
                fileops.move_to_other_dir(entry.path, collected)
                log.info("[queue] %s was consumed after the checkpoint: back in the queue", job_id)
            except FileExistsError:
                if os.path.samefile(entry.path, collected):  # the old PS died inside consume()'s link + unlink
                    fileops.unlink_second_name(entry.path)
                    log.info("[queue] %s: its archiving as consumed was cut short; back in the queue", job_id)
                else:
                    log.warning("[queue] %s: a collected copy already waits; keeping the archive", job_id)

    def finish(self) -> None:
        """End of training: every job and result left in queue/ is archived 'unused'.

        Jobs in workers' hands are waited for (at most a lease) and their results archived.
        Nothing goes back to pending (a worker would take it with no one left to collect), and
        the loop repeats until queue/ is empty: a worker relaunched now may release a job."""
        self._stop_pipeline()
        deadline = time.monotonic() + self.cfg.lease_s
        while True:
            self._archive_pending_as_unused()
            self.queue.recover(lease_s=self.cfg.lease_s, max_attempts=self.cfg.max_attempts, requeue=False)
            for result in self.queue.collect(readopt=True) + self.cache.drain():
                self.queue.archive_if_present(result.path, result.job_id, ArchiveReason.UNUSED, result.attempt)
            if not self.queue.scan()[0]:
                break
            if time.monotonic() > deadline:
                log.warning("[queue] finishing with files still in queue/ after %gs: %s", self.cfg.lease_s,
                            self.queue.counts())
                break
            time.sleep(0.05)  # workers finish the job in hand, far sooner than a lease expires
        self.publisher.close()
        log.info("[queue] finished: %s", self.queue.counts())
        self.events.close()

    def _archive_pending_as_unused(self) -> None:
        for name in self.queue.scan()[0]:
            if name.state is JobState.PENDING:
                self.queue.archive_if_present(self.queue.path(name), name.job_id, ArchiveReason.UNUSED, name.attempt)

    # ------------------------------------------------------------------ the replaced TRL internal

    def _generate_and_score_completions(self, inputs):
        if not self.model.training:  # evaluation generates here, as TRL does
            return super()._generate_and_score_completions(inputs)
        started = time.monotonic()
        result, staleness = self._take_result()
        waited = time.monotonic() - started
        step = self.state.global_step + 1  # the step this result trains
        self.events.emit("wait_result", step=step, dur_ms=waited * 1e3)
        self.consumed.add(result.job_id)
        self.producer.wake()
        batch = result.data["batch"]
        self.events.emit("result_consumed", job_id=result.job_id, weights_version=result.payload["weights_version"],
                         step=step, staleness=staleness, samples=int(batch["advantages"].numel()),
                         tokens=int(batch["completion_mask"].sum()))
        self._step_wait_s += waited
        self._step_record["trainer_wait_s"] += waited
        self._step_record["staleness"].append(staleness)
        self._step_record["weights_versions"].append(result.payload["weights_version"])
        for name, value in result.data["metrics"].items():  # the worker's TRL metrics for this job
            self._metrics["train"][name].append(value)
        device = self.accelerator.device
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def _take_result(self):
        """The next usable result and its staleness; stale and duplicate ones are archived on the way."""
        started = time.monotonic()
        while True:
            result = self.cache.take(self._pick, timeout=WAIT_REPORT_S)
            if result is None:
                log.warning("[train] step=%d has waited %.0fs for a result; queue %s", self.state.global_step,
                            time.monotonic() - started, self.queue.counts())
                continue
            staleness = self.state.global_step - result.payload["weights_version"]
            if staleness > self.cfg.max_staleness:
                log.info("[queue] %s is %d steps stale (max %d): archived, prompts thrown again",
                         result.job_id, staleness, self.cfg.max_staleness)
                self.queue.archive_if_present(result.path, result.job_id, ArchiveReason.STALE, result.attempt)
                self.producer.rethrow(result.data["rows"])
                continue
            if result.job_id in self.consumed:  # in the checkpoint's ledger, though not archived so
                self.queue.archive_if_present(result.path, result.job_id, ArchiveReason.DUPLICATE, result.attempt)
                continue
            if self.queue.consume(result):  # False: a duplicate, archived as such
                return result, staleness

    def _pick(self, cached: dict) -> str | None:
        if not cached:
            return None
        oldest = min(cached)
        if self.cfg.consume_order == "fifo":
            active = [n.job_id for n in self.queue.scan()[0] if n.state in ACTIVE]
            if active and min(active) < oldest:
                return None  # an older job is still on its way
        return oldest

    # ------------------------------------------------------------------ after each step

    def on_optimizer_step_begin(self) -> None:
        self._step_started, self._step_wait_s = time.monotonic(), 0.0
        self.events.emit("train_step_start", step=self.state.global_step + 1)

    def on_optimizer_step_end(self) -> None:
        step = self.state.global_step
        self.events.emit("train_step_end", step=step, dur_ms=(time.monotonic() - self._step_started) * 1e3,
                         wait_ms=self._step_wait_s * 1e3)
        self._publish_weights()
        fileops.replace_file(self.run.root / "global_step.txt", f"{step}\n".encode())
        self.producer.wake()

    def _publish_weights(self) -> None:
        step = self.state.global_step
        started = time.monotonic()
        self.publisher.publish(version=step, step=step)
        publish_ms = (time.monotonic() - started) * 1e3
        self.events.emit("weights_published", weights_version=step, dur_ms=publish_ms,
                         bytes=self.publisher.layout.total_bytes)
        log.debug("[weights] published version=%d publish_ms=%.1f", step, publish_ms)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        record = self._step_record
        is_step_log = self.model.training and "loss" in logs and record["staleness"]
        if is_step_log:  # asyncgrpo's own metrics go to report_to integrations with TRL's
            logs.update({"staleness/mean": statistics.fmean(record["staleness"]),
                         "staleness/max": max(record["staleness"]),
                         "weights_version": max(record["weights_versions"]),
                         "trainer_wait_s": round(record["trainer_wait_s"], 4)})
        super().log(logs, start_time)  # TRL averages its metrics (reward, ...) into logs
        if not is_step_log:
            return
        now = time.monotonic()
        line = {
            "step": self.state.global_step,
            "reward": logs.get("reward"),
            "reward_std": logs.get("reward_std"),
            "loss": logs.get("loss"),
            "staleness_mean": logs["staleness/mean"],
            "staleness_max": logs["staleness/max"],
            "weights_version": logs["weights_version"],
            "trainer_wait_s": logs["trainer_wait_s"],
            "step_time_s": round(now - self._last_step_end, 4),
            "queue_depth": self.queue.counts(),
            "time": time.time(),
        }
        self._last_step_end = now
        self._step_record = _new_step_record()
        with open(self.run.root / "metrics.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        self._show_progress(line)

    def _show_progress(self, line: dict) -> None:
        depth = line["queue_depth"]
        log.info("[train] step=%d reward=%.3f staleness=%.1f wait_ms=%.0f loss=%s queue=pending:%d processing:%d "
                 "complete:%d", line["step"], line["reward"], line["staleness_mean"], line["trainer_wait_s"] * 1e3,
                 f"{line['loss']:.4f}" if line["loss"] is not None else "-", depth["pending"],
                 depth["processing"] + depth["committing"], depth["complete"] + depth["collected"])
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, ProgressCallback) and callback.training_bar is not None:
                callback.training_bar.set_postfix(reward=f"{line['reward']:.3f}",
                                                  staleness=f"{line['staleness_mean']:.1f}",
                                                  wait_ms=f"{line['trainer_wait_s'] * 1e3:.0f}", refresh=False)

    def _save_checkpoint(self, model, trial):
        # The ledger goes last: it marks the checkpoint complete (see last_complete_checkpoint).
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        fileops.write_json(os.path.join(folder, LEDGER_FILE),
                           {"consumed": sorted(self.consumed), "global_step": self.state.global_step}, fsync=True)


class _PipelineCallback(TrainerCallback):
    def __init__(self, trainer: AsyncGRPOTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._start_pipeline()

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.on_optimizer_step_begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.on_optimizer_step_end()



def _new_step_record() -> dict:
    return {"staleness": [], "trainer_wait_s": 0.0, "weights_versions": []}
