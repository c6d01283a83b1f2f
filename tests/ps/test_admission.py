"""Admission (ps/admission.py): the staleness bound and the caps, decided on one snapshot.

tests/ps/test_pipeline.py checks the same bound through the running producer and queue; here each
term of it is moved on its own.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from ps.admission import Limits, Snapshot, admit

LIMITS = Limits(max_staleness=3, steps_per_job=1, max_pending=8, max_outstanding=16)


def snapshot(**fields) -> Snapshot:
    values = {"published_version": 0, "in_queue": frozenset(), "pending": frozenset(), "cached": frozenset(),
              "judging": None, "next_take_step": 0}
    values.update({k: frozenset(v) if isinstance(v, (set, list)) else v for k, v in fields.items()})
    return Snapshot(**values)


def test_jobs_are_thrown_while_every_result_in_flight_can_still_be_trained_within_the_bound():
    # next_take_step + in_flight * steps_per_job - oldest <= max_staleness: 0 + 3 - 0 <= 3, 0 + 4 - 0 > 3
    three = snapshot(in_queue={"a", "b", "c"}, pending={"a", "b", "c"})
    assert admit(three, LIMITS, {}).throw
    four = replace(three, in_queue={"a", "b", "c", "d"}, pending={"a", "b", "c", "d"})
    decision = admit(four, LIMITS, {})
    assert not decision.throw and "4 steps stale (max_staleness 3)" in decision.why_not
    # Each job trains two steps: two in flight are already one step too many.
    assert not admit(snapshot(in_queue={"a", "b"}, pending={"a", "b"}), replace(LIMITS, steps_per_job=2), {}).throw
    # The trainer's progress counts as much as the jobs in flight.
    assert not admit(replace(three, next_take_step=1), LIMITS, {}).throw


def test_a_job_held_by_a_worker_keeps_the_floor_it_was_last_seen_pending_with():
    pending = snapshot(published_version=5, in_queue={"a"}, pending={"a"}, next_take_step=5)
    floors = admit(pending, LIMITS, {}).version_floor
    assert floors == {"a": 5}
    # Claimed, and the weights moved on to 9: its worker may have synced 5, and the bound counts from there.
    held = snapshot(published_version=9, in_queue={"a"}, next_take_step=8)
    decision = admit(held, LIMITS, floors)
    assert decision.version_floor == {"a": 5} and not decision.throw  # 8 + 1 - 5 > 3
    # Collected (in the cache): its version is known, it leaves the floors.
    assert admit(replace(held, cached={"a"}), LIMITS, floors).version_floor == {}
    # A job never seen pending (claimed between two scans) gets the version published before this scan.
    assert admit(held, LIMITS, {}).version_floor == {"a": 9}


def test_a_straggler_leaves_the_bound_but_is_still_in_flight():
    floors = {"slow": 0, "b": 6}
    held = snapshot(published_version=6, in_queue={"slow", "b"}, next_take_step=6)
    assert not admit(held, LIMITS, floors).throw  # 6 + 2 - 0 > 3
    decision = admit(replace(held, stragglers={"slow"}), LIMITS, floors)
    assert decision.throw and decision.version_floor == floors  # 6 + 2 - 6 <= 3: its floor kept, not counted


def test_the_result_being_judged_counts_as_in_flight():
    cached = snapshot(in_queue={"a", "b", "c"}, cached={"c"})
    assert admit(cached, LIMITS, {}).throw  # 3 in flight
    assert not admit(replace(cached, judging="d"), LIMITS, {}).throw  # and the one out of the cache: 4


def test_dynamic_sampling_throws_more_when_fewer_groups_are_trained():
    five = snapshot(in_queue={"a", "b", "c", "d", "e"}, pending={"a", "b", "c", "d", "e"})
    assert not admit(five, LIMITS, {}).throw
    assert admit(replace(five, expected_yield=0.5), LIMITS, {}).throw  # 5 x 0.5 = 2.5 batches in flight


@pytest.mark.parametrize("limits, why", [
    (replace(LIMITS, max_pending=2), "2 jobs pending (max_pending 2)"),
    (replace(LIMITS, max_outstanding=2), "2 jobs in flight (max_outstanding 2)"),
])
def test_the_caps_hold_whatever_the_bound_allows(limits, why):
    two = snapshot(in_queue={"a", "b"}, pending={"a", "b"})
    decision = admit(two, replace(limits, max_staleness=100), {})
    assert not decision.throw and decision.why_not == why


def test_a_job_claimed_again_after_its_worker_died_is_timed_from_its_new_claim():
    """The hold that makes a straggler is an attempt's: a recovered job claimed by another worker is not the dead
    worker's hold, and the dead one's is no generation time for the typical time either."""
    from asyncgrpo.jobqueue.names import JobState, QueueName
    from ps.producer import STRAGGLER_MIN_S, HoldTimes

    times = HoldTimes()
    for i in range(3):  # three jobs of 0.3 s: a typical time
        times.observe([QueueName(f"00000{i}_000", 1, JobState.PROCESSING, 1)], now=10.0 * i)
        times.observe([QueueName(f"00000{i}_000", 1, JobState.COMPLETE, 1)], now=10.0 * i + 0.3)
    assert list(times.recent) == pytest.approx([0.3] * 3)
    job = "000035_000"
    times.observe([QueueName(job, 1, JobState.PROCESSING, 1)], now=100.0)  # dev1 claims it, and dies
    late = 100.0 + STRAGGLER_MIN_S + 1
    times.observe([QueueName(job, 2, JobState.PROCESSING, 2)], now=late)  # recovered, claimed by dev2 at once
    assert times.stragglers(late + 0.05) == {}
    assert list(times.recent) == pytest.approx([0.3] * 3)  # (the dead worker's hold is not counted)
    assert times.stragglers(late + STRAGGLER_MIN_S + 1) == {(job, 2): pytest.approx(STRAGGLER_MIN_S + 1)}
    times.observe([QueueName(job, 1, JobState.COMPLETE, 2)], now=late + 0.4)  # (a result's name has no attempt)
    assert list(times.recent) == pytest.approx([0.3] * 3 + [0.4])  # the second attempt's generation time
    times.observe([QueueName("000036_000", 1, JobState.PROCESSING, 1)], now=200.0)
    times.observe([QueueName("000036_000", 1, JobState.PENDING)], now=200.5)  # given back: no generation time
    assert len(times.recent) == 4 and times.held_since == {}
