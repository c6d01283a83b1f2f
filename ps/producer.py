"""The job producer: a thread that keeps the queue fed with generation batches.

Part of the job pipeline (ps/pipeline.py). One job holds one generation batch:
``generation_batch_size`` dataset rows, each prompt repeated ``num_generations`` times,
drawn in TRL's order (its RepeatSampler, seeded). Rows owed a re-throw (their result came
back too stale) go out before new ones.

Difficulty filtering (``--difficulty_filter K``, as prime-rl's online difficulty filtering): a
prompt whose last K groups all scored alike (all right or all wrong, as the pipeline judges
them) is settled; when a newly drawn batch holds it, its group is set aside for
``--difficulty_filter_wait`` batches and the job filled up from the next; then it comes back
(and is thrown whatever it has become). Nothing leaves the epoch's accounting: rows set aside
are in the journal, and counted (``prompts_skipped``).

Admission (ps/admission.py): a job is thrown only while every result in flight can still be trained within
``max_staleness``; the producer reads the snapshot admission decides on.

Stragglers: a job a worker has held STRAGGLER_FACTOR times longer than the typical job (the median
of the last jobs, at least STRAGGLER_MIN_S) no longer holds admission back: its floor leaves the
bound, so the other workers keep generating and the trainer keeps training. Nothing is lost or
trained twice either way: its late result is trained if it is still within ``max_staleness`` when
taken, else archived ``stale`` and its prompts thrown again; a worker that went silent has the job
recovered when its lease expires (and its late result is then fenced out).

The producer's journal, ``RUN/producer.json``, is written before each job file appears: the
job id is reserved (ids never repeat, also across a PS crash) and the rows it carries are
recorded, so a PS killed between the two throws them again instead of losing them. It also
holds the rows owed a re-throw and the rows set aside.
"""

from __future__ import annotations

import itertools
import json
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from datasets import IterableDataset
from trl.trainer.utils import RepeatSampler, repeat_iterable_dataset

from asyncgrpo.config import AsyncGRPOConfig, ConfigError
from asyncgrpo.jobqueue import ArchiveReason, JobQueue, JobState, QueueWatcher
from asyncgrpo.jobqueue.handoff import JobData
from asyncgrpo.jobqueue.names import next_job_id
from asyncgrpo.run import fileops
from ps.admission import Limits, Snapshot, admit
from ps.background import WatchedThread
from ps.collector import ResultCache

log = logging.getLogger("asyncgrpo.ps")
STRAGGLER_FACTOR = 3.0  # held this many typical job times: a straggler
STRAGGLER_MIN_S = 1.0
TYPICAL_OF_LAST = 20  # jobs the typical time is the median of (none is judged a straggler before 3)
HELD = (JobState.PROCESSING, JobState.COMMITTING)


def too_few_prompts(size: int, G: int) -> ConfigError:
    return ConfigError(f"the dataset has fewer than {size // G} prompts: not one generation batch of {size} rows "
                       f"({G} generations each)")


@dataclass
class TrainingProgress:
    """The trainer's progress as admission reads it; the pipeline writes it (ps/pipeline.py) from the
    trainer's thread, this thread only reads.

    ``judging`` is a result out of the cache not yet accounted for in ``next_take_step`` (or archived):
    still in flight for admission, which would otherwise see it nowhere for that moment. The pipeline
    moves ``next_take_step`` on before it clears ``judging``, and admission reads them the other way round.
    """

    published_version: int = 0  # the newest weights a worker can sync
    next_take_step: int = 0  # the trainer's step when it takes its next result
    judging: str | None = None
    expected_yield: float = 1.0  # the batches one result is expected to fill (< 1 with dynamic sampling)


class HoldTimes:
    """How long workers hold jobs, from the producer's scans: since an attempt of a job is first seen held until it
    is first seen done. Knows the typical time and which jobs are held far longer (stragglers)."""

    def __init__(self):
        self.held_since: dict[tuple[str, int], float] = {}  # by (job id, attempt)
        self.recent: deque[float] = deque(maxlen=TYPICAL_OF_LAST)
        self.reported: set[tuple[str, int]] = set()  # stragglers already logged

    def observe(self, names: list, now: float) -> None:
        states = {(name.job_id, name.attempt): name.state for name in names}
        # A job given back (pending) or recovered (pending or held again as its next attempt: a dead worker's hold,
        # which the worker that claims it again does not inherit). Results carry no attempt in their names.
        again = {name.job_id for name in names if name.state is JobState.PENDING or name.state in HELD}
        for key, state in states.items():
            if state in HELD:
                self.held_since.setdefault(key, now)
        for key in [k for k in self.held_since if states.get(k) not in HELD]:
            since = self.held_since.pop(key)
            if key[0] not in again:  # (not a generation time otherwise)
                self.recent.append(now - since)
            self.reported.discard(key)

    def straggler_after_s(self) -> float | None:
        if len(self.recent) < 3:
            return None
        return max(STRAGGLER_MIN_S, STRAGGLER_FACTOR * statistics.median(self.recent))

    def stragglers(self, now: float) -> dict[tuple[str, int], float]:
        """(job id, attempt) -> seconds held, of the attempts held past straggler_after_s."""
        after = self.straggler_after_s()
        if after is None:
            return {}
        return {key: now - since for key, since in self.held_since.items() if now - since > after}

    def next_straggler_in_s(self, now: float) -> float | None:
        """Seconds until the next held job turns straggler (None: none will without a new scan)."""
        after = self.straggler_after_s()
        if after is None:
            return None
        return min((since + after - now for since in self.held_since.values() if since + after > now), default=None)


class SettledPrompts:
    """Difficulty filtering: each prompt's last ``window`` outcomes, True where its group's rewards did not spread
    (all right, or all wrong). A prompt is settled when each of its last ``window`` groups was so; 0 turns it off.
    The pipeline records outcomes from the trainer's thread, the producer reads them from its own."""

    def __init__(self, window: int):
        self.window = window
        self.lock = threading.Lock()
        self.outcomes: dict[str, deque] = {}

    @staticmethod
    def key(row: dict) -> str:
        return json.dumps(row.get("prompt"), sort_keys=True, default=str)

    def record(self, row: dict, flat: bool) -> None:
        if self.window:
            with self.lock:
                self.outcomes.setdefault(self.key(row), deque(maxlen=self.window)).append(flat)

    def settled(self, row: dict) -> bool:
        if not self.window:
            return False
        with self.lock:
            last = self.outcomes.get(self.key(row), ())
            return len(last) == self.window and all(last)


class JobProducer(WatchedThread):
    def __init__(self, cfg: AsyncGRPOConfig, queue: JobQueue, dataset, progress: TrainingProgress,
                 cache: ResultCache, on_error):
        super().__init__("job producer", QueueWatcher(queue.run.queue, {JobState.PROCESSING},
                                                      use_events=not cfg.poll_only), on_error)
        self.cfg, self.queue, self.dataset, self.progress, self.cache = cfg, queue, dataset, progress, cache
        self.journal_path = queue.run.producer_journal
        self.lock = threading.Lock()  # the trainer adds owed rows while this thread throws
        self.batches_drawn = 0
        self.last_job_id: str | None = None
        self.last_rows: list = []
        self.owed: list[dict] = []  # {"from_job": id, "rows": [...]}, oldest first
        # Difficulty filtering: groups of prompts settled lately, {"rows": [...], "until": batches_drawn}.
        self.set_aside: list[dict] = []
        self.prompts_skipped = 0
        self.settled = SettledPrompts(cfg.difficulty_filter)
        self.limits = Limits.of(cfg)
        self.version_floor: dict[str, int] = {}  # admission's, from one decision to the next
        self.hold_times = HoldTimes()

    # ------------------------------------------------------------------ durable state

    def state_dict(self) -> dict:
        with self.lock:
            return self._journal()

    def _journal(self) -> dict:
        return {"batches_drawn": self.batches_drawn, "last_job_id": self.last_job_id, "last_rows": self.last_rows,
                "owed": list(self.owed), "set_aside": list(self.set_aside), "prompts_skipped": self.prompts_skipped}

    def load_state(self, checkpointed: dict | None) -> None:
        """Resumes from the journal (or the checkpoint's copy when the journal is missing or older):
        rows of a job whose file never appeared, and rows owed by results still in the queue and never
        archived stale (the PS died before the archive: they are judged again), are settled here."""
        journal = fileops.read_json(self.journal_path) or {}
        saved = max((journal, checkpointed or {}), key=lambda s: int(s.get("batches_drawn", 0)))
        self.batches_drawn = int(saved.get("batches_drawn", 0))
        self.last_job_id = saved.get("last_job_id")
        self.last_rows = saved.get("last_rows") or []
        names = self.queue.scan()[0]
        active = {name.job_id for name in names}
        self.owed = [entry for entry in saved.get("owed", []) if not self._judged_again(entry["from_job"], names)]
        self.set_aside = saved.get("set_aside", [])
        self.prompts_skipped = int(saved.get("prompts_skipped", 0))
        if self.last_job_id and self.last_rows and not self.queue.has_files_of(self.last_job_id):
            log.info("[queue] job %s was reserved but never written: its rows are thrown again", self.last_job_id)
            self.owed.insert(0, {"from_job": self.last_job_id, "rows": self.last_rows})
        newest_in_queue = max(active, default=None)
        if newest_in_queue and (self.last_job_id is None or newest_in_queue > self.last_job_id):
            self.last_job_id = newest_in_queue  # the journal was lost: never reuse an id in the queue
        self._batches = self.generation_batches()
        for _ in range(self.batches_drawn):  # skip what an earlier PS already threw
            next(self._batches)

    def _judged_again(self, job_id: str | None, names: list) -> bool:
        """Whether the result that owed these rows is still in the queue and not archived stale: a PS killed between
        the journal and the archive. Judged again, it owes them again if it is still too stale. With a stale archive
        of it in done/, what is queued is another attempt of its job (a duplicate now) or the archive's own file (a
        PS killed inside the move): the rows stay owed."""
        attempts = [name.attempt for name in names if name.job_id == job_id]
        return bool(attempts) and not self.queue.was_archived(job_id, (ArchiveReason.STALE,),
                                                              max(self.cfg.max_attempts, *attempts))

    def owe(self, job_id: str, rows: list, archive: Callable[[], object]) -> None:
        """The result of ``job_id`` is discarded: its rows go out again. The journal first (a crash loses no rows),
        then ``archive`` takes the result out of the queue, both under the lock a throw takes: no job holds these
        rows while the result is still in the queue, where a PS killed in between would find it at its restart and
        judge it again (load_state drops the rows owed by a result still queued)."""
        with self.lock:
            self.owed.append({"from_job": job_id, "rows": rows})
            self._write_journal()
            archive()
        self.watcher.wake()

    def _write_journal(self) -> None:
        fileops.write_json(self.journal_path, self._journal(), fsync=True)

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            while self.may_throw() and not self.stop_event.is_set():
                self.throw()
            self.watcher.wait(self.hold_times.next_straggler_in_s(time.monotonic()))

    def may_throw(self) -> bool:
        """Admission (ps/admission.py) over a snapshot read now."""
        decision = admit(self.snapshot(), self.limits, self.version_floor)
        self.version_floor = decision.version_floor
        return decision.throw

    def snapshot(self) -> Snapshot:
        """What admission reads, in this order. The published version before the scan: a job still pending in
        the scan is claimed after this read, and its worker syncs at least these weights (published versions
        only grow). Then the result being judged, then next_take_step: a result taken from the cache since the
        scan is either still judging or already counted in next_take_step (the pipeline moves next_take_step
        on before it clears judging)."""
        published = self.progress.published_version
        names = self.queue.scan()[0]  # every job in queue/ is in flight
        cached = self.cache.versions()
        judging = self.progress.judging
        next_take_step = self.progress.next_take_step
        now = time.monotonic()
        self.hold_times.observe(names, now)
        stragglers = self.hold_times.stragglers(now)
        self._report(stragglers, names)
        return Snapshot(published, frozenset(n.job_id for n in names),
                        frozenset(n.job_id for n in names if n.state is JobState.PENDING), frozenset(cached),
                        judging, next_take_step, self.progress.expected_yield,
                        frozenset(job_id for job_id, _ in stragglers))

    def _report(self, stragglers: dict[tuple[str, int], float], names: list) -> None:
        new = stragglers.keys() - self.hold_times.reported
        holders = {(name.job_id, name.attempt): name.device for name in names if (name.job_id, name.attempt) in new}
        for key in sorted(new):
            self.hold_times.reported.add(key)
            log.warning("[queue] job %s: worker dev%s has held it %.1fs (typically %.1fs): a straggler; the other "
                        "workers go on without it (its result is trained if still within max_staleness, else thrown "
                        "again; a silent worker's job comes back after its lease)", key[0], holders.get(key, "?"),
                        stragglers[key], statistics.median(self.hold_times.recent))
            self.queue.events.emit("job_straggling", job_id=key[0], held_s=round(stragglers[key], 3),
                                   worker=str(holders.get(key)))

    def generation_batches(self):
        """Generation batches in TRL's order, epoch after epoch (training length is max_steps). The same config
        draws the same batches in any process, which is what lets a resumed PS skip what it already threw."""
        size, G = self.cfg.generation_batch_size, self.cfg.num_generations
        if isinstance(self.dataset, IterableDataset):
            yield from self._streamed_batches(size, G)
            return
        sampler = RepeatSampler(self.dataset, mini_repeat_count=G, batch_size=size // G, repeat_count=1,
                                shuffle=self.cfg.shuffle_dataset, seed=self.cfg.seed)
        while True:
            indices = list(sampler)
            if len(indices) < size:
                raise too_few_prompts(size, G)
            for start in range(0, len(indices) - size + 1, size):
                yield [self.dataset[i] for i in indices[start:start + size]]

    def _streamed_batches(self, size: int, G: int):
        """A streamed dataset as TRL's get_train_dataloader reads it: a buffered shuffle seeded with --seed and
        reshuffled each epoch (set_epoch), each prompt repeated G times, a short last batch dropped."""
        stream = self.dataset.shuffle(seed=self.cfg.seed) if self.cfg.shuffle_dataset else self.dataset
        stream = repeat_iterable_dataset(stream, mini_repeat_count=G, batch_size=size // G, repeat_count=1)
        for epoch in itertools.count():
            stream.set_epoch(epoch)
            rows = iter(stream)
            batch = list(itertools.islice(rows, size))
            if len(batch) < size:
                raise too_few_prompts(size, G)
            while len(batch) == size:
                yield batch
                batch = list(itertools.islice(rows, size))

    def _next_rows(self) -> list:
        """The next job's rows: owed rows first, then rows set aside that are due back, then the next batch drawn.
        With difficulty filtering, the groups of a newly drawn batch whose prompt is settled are set aside for
        ``difficulty_filter_wait`` batches, and the job is filled up from what comes next (rows beyond it are owed
        first). Called under the lock; the caller journals what it changed."""
        size, G = self.cfg.generation_batch_size, self.cfg.num_generations
        rows: list = []
        while len(rows) < size:
            due = next((entry for entry in self.set_aside if entry["until"] <= self.batches_drawn), None)
            if self.owed:
                rows += self.owed.pop(0)["rows"]
            elif due is not None:
                self.set_aside.remove(due)
                rows += due["rows"]
            else:
                batch = next(self._batches)
                self.batches_drawn += 1
                for start in range(0, len(batch), G):
                    group = batch[start:start + G]
                    if self.settled.settled(group[0]):
                        self.set_aside.append({"rows": group, "until": self.batches_drawn
                                               + self.cfg.difficulty_filter_wait})
                        self.prompts_skipped += 1
                    else:
                        rows += group
        if rows[size:]:
            self.owed.insert(0, {"from_job": None, "rows": rows[size:]})
        return rows[:size]

    def throw(self) -> None:
        """Throws the next job: owed rows first (see _next_rows); the journal is written before the job file."""
        with self.lock:
            rows = self._next_rows()
            job_id = next_job_id(self.last_job_id, self.progress.next_take_step)
            self.last_job_id, self.last_rows = job_id, rows
            self._write_journal()  # before the file exists: the id is taken and the rows accounted for
        # Synchronous mode (max_staleness 0) needs the newest weights; otherwise any are fine,
        # since a worker syncs before each job anyway.
        created_step = self.progress.next_take_step
        min_version = max(0, created_step - self.cfg.max_staleness)
        # Before the put: a worker may claim the job the moment its file appears.
        self.queue.events.emit("job_created", job_id=job_id, weights_version=min_version, rows=len(rows),
                               created_step=created_step)
        self.version_floor[job_id] = self.progress.published_version  # before a worker can claim it
        self.queue.put_job(job_id, JobData(rows, min_version).to_dict(), created_step=created_step)
        log.debug("[queue] threw job %s (%d rows, min_weights_version=%d)", job_id, len(rows), min_version)
