"""Admission: whether the producer may throw one more job, as a function of one snapshot of the run.

A job is thrown only if every result in flight can still be trained within ``max_staleness``. A
result's staleness is the number of optimizer steps between its weights version and the step that
takes it; each job trains ``steps_per_job`` steps, and in the worst case every other job in flight is
trained before the oldest one, so a job is thrown only while

    next_take_step + in_flight * expected_yield * steps_per_job - oldest_version <= max_staleness

where ``next_take_step`` is the trainer's step when it takes its next result, ``in_flight`` counts the
jobs in queue/, the results in the cache and the one being judged, ``expected_yield`` is the fraction of a
result's groups that are trained (1, or with dynamic sampling as measured over the last results: more
jobs are thrown when most groups are dropped), and ``oldest_version`` is the lowest weights version any
job not yet collected can have been generated with. A pending job will sync at least the version
published when it was last seen pending, so that is its floor (``version_floor``, carried from one
decision to the next). A straggler's floor leaves the bound (ps/producer.py HoldTimes). Also at most
``max_pending`` pending and ``max_outstanding`` in flight.

``Snapshot`` is what the producer reads, in the order that makes it safe (JobProducer.snapshot);
``admit`` is pure: the same snapshot and floors give the same decision.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_staleness: int
    steps_per_job: int
    max_pending: int
    max_outstanding: int

    @classmethod
    def of(cls, cfg) -> Limits:
        return cls(cfg.max_staleness, cfg.steps_per_job, cfg.max_pending, cfg.max_outstanding)


@dataclass(frozen=True)
class Snapshot:
    published_version: int  # the newest weights a worker can sync, read before the queue was scanned
    in_queue: frozenset[str]  # job ids with a file in queue/ (any state)
    pending: frozenset[str]  # of those, the pending ones
    cached: frozenset[str]  # job ids of results in the cache
    judging: str | None  # the result the trainer took from the cache and has not accounted for yet
    next_take_step: int
    expected_yield: float = 1.0
    stragglers: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Decision:
    throw: bool
    version_floor: dict[str, int]  # each job not yet collected: the oldest weights it can be generated with
    why_not: str | None = None  # the bound that holds the next job back


def admit(snapshot: Snapshot, limits: Limits, version_floor: dict[str, int]) -> Decision:
    """May one more job be thrown? ``version_floor`` is the previous decision's (empty at first)."""
    floors = {}
    for job_id in sorted(snapshot.in_queue - snapshot.cached):
        floor = snapshot.published_version if job_id in snapshot.pending else version_floor.get(job_id)
        floors[job_id] = snapshot.published_version if floor is None else floor
    in_flight = len(snapshot.in_queue | snapshot.cached | ({snapshot.judging} if snapshot.judging else set()))
    if len(snapshot.pending) >= limits.max_pending:
        return Decision(False, floors, f"{len(snapshot.pending)} jobs pending (max_pending {limits.max_pending})")
    if in_flight >= limits.max_outstanding:
        return Decision(False, floors, f"{in_flight} jobs in flight (max_outstanding {limits.max_outstanding})")
    oldest = min((floor for job_id, floor in floors.items() if job_id not in snapshot.stragglers),
                 default=snapshot.published_version)
    worst = snapshot.next_take_step + in_flight * snapshot.expected_yield * limits.steps_per_job - oldest
    if worst > limits.max_staleness:
        return Decision(False, floors, f"a result in flight could be trained {worst:g} steps stale "
                                       f"(max_staleness {limits.max_staleness})")
    return Decision(True, floors)
