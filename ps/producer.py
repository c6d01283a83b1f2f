"""The job producer: a thread that keeps the queue fed with generation batches.

One job holds one generation batch: ``generation_batch_size`` dataset rows, each prompt
repeated ``num_generations`` times, drawn in TRL's order (its RepeatSampler, seeded).
Flow control: at most ``max_pending`` jobs pending and at most ``cfg.outstanding_limit``
thrown and not yet consumed. Prompts of results that came back too stale are thrown
again before new ones.

Its position survives a PS restart in ``RUN/producer.json`` (written on every throw), so
a relaunch neither repeats prompts already thrown nor reuses a job id.
"""

from __future__ import annotations

import collections
import logging

from trl.trainer.utils import RepeatSampler

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.jobqueue import JobQueue, JobState, QueueWatcher, fileops
from ps.background import WatchedThread

log = logging.getLogger("asyncgrpo.ps")


class JobProducer(WatchedThread):
    def __init__(self, cfg: AsyncGRPOConfig, queue: JobQueue, dataset, consumed_count, current_step):
        super().__init__("job-producer", QueueWatcher(queue.run.queue, {JobState.PROCESSING},
                                                      use_events=not cfg.poll_only))
        self.cfg, self.queue, self.dataset = cfg, queue, dataset
        self.consumed_count, self.current_step = consumed_count, current_step  # callables into the trainer
        self.state_path = queue.run.root / "producer.json"
        saved = fileops.read_json(self.state_path) or {}
        self.batches_drawn = int(saved.get("batches_drawn", 0))
        self.last_job_id = saved.get("last_job_id")
        self.rethrow_rows: collections.deque[list] = collections.deque()
        self._batches = self._generation_batches()
        for _ in range(self.batches_drawn):  # resume: skip what an earlier PS already threw
            next(self._batches)

    def rethrow(self, rows: list) -> None:
        self.rethrow_rows.append(rows)
        self.watcher.wake()

    def _generation_batches(self):
        size = self.cfg.generation_batch_size
        sampler = RepeatSampler(self.dataset, mini_repeat_count=self.cfg.num_generations,
                                batch_size=size // self.cfg.num_generations, repeat_count=1,
                                shuffle=self.cfg.shuffle_dataset, seed=self.cfg.seed)
        while True:  # epochs without end: training length is max_steps
            indices = list(sampler)
            for start in range(0, len(indices) - size + 1, size):
                yield [self.dataset[i] for i in indices[start:start + size]]

    def _next_job_id(self) -> str:
        step = self.current_step()
        if self.last_job_id is not None:  # ids only grow, also across a PS restart
            last_step, last_index = (int(part) for part in self.last_job_id.split("_"))
            if step <= last_step:
                step, index = (last_step, last_index + 1) if last_index < 999 else (last_step + 1, 0)
                return f"{step:06d}_{index:03d}"
        return f"{step:06d}_000"

    def _run(self) -> None:
        while not self.stop_event.is_set():
            counts = self.queue.counts()
            pending, outstanding = counts[JobState.PENDING.value], sum(counts.values())
            while pending < self.cfg.max_pending and outstanding < self.cfg.outstanding_limit:
                if self.stop_event.is_set():
                    return
                self._throw()
                pending, outstanding = pending + 1, outstanding + 1
            self.watcher.wait()

    def _throw(self) -> None:
        if self.rethrow_rows:
            rows = self.rethrow_rows.popleft()
        else:
            rows = next(self._batches)
            self.batches_drawn += 1
        job_id = self._next_job_id()
        # Synchronous mode (max_staleness 0) needs the newest weights; otherwise any are fine,
        # since a worker syncs before each job anyway.
        min_version = max(0, self.consumed_count() - self.cfg.max_staleness)
        # Before the put: a worker may claim the job the moment its file appears.
        self.queue.events.emit("job_created", job_id=job_id, weights_version=min_version, rows=len(rows),
                               created_step=self.current_step())
        self.queue.put_job(job_id, {"rows": rows, "min_weights_version": min_version},
                           created_step=self.current_step())
        self.last_job_id = job_id
        fileops.write_json(self.state_path, {"batches_drawn": self.batches_drawn, "last_job_id": job_id})
        log.debug("[queue] threw job %s (%d rows, min_weights_version=%d)", job_id, len(rows), min_version)
