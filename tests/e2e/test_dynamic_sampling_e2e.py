"""Dynamic sampling end to end: a real PS and worker on the binary first_digit task, the PS killed inside a save
while a result is split across batches, then relaunched on the same run directory."""

import json
import signal
import time

from helpers import (
    LEDGER_FILE,
    assert_groups_exactly_once,
    expect_exit,
    metrics,
    ps_events,
    run_flags,
    start_faulty_ps,
    start_process,
)

from asyncgrpo.jobqueue.names import done_reason
from asyncgrpo.run import RunDir, fileops
from queue_tools.cli import format_report, inspect_run
from queue_tools.report import format_text, make_report

TIMEOUT_S = 600
STEPS = 14
FLAGS = ["--builtin_task", "first_digit", "--max_steps", str(STEPS), *run_flags(save_steps=1)]


def test_a_result_split_across_a_kill_trains_each_group_once_and_no_zero_variance_group(tmp_path):
    run_root = tmp_path / "run"
    # Killed in the first save (from checkpoint-3 on) that follows a checkpoint holding a result partly trained:
    # the relaunched PS resumes from that checkpoint and must train the rest of that result's groups, once.
    ps = start_faulty_ps(run_root, tmp_path / "ps.log", "kill-after-split", 3, *FLAGS, "--dynamic_sampling")
    worker = start_process(run_root, tmp_path / "w1.log", "worker", "--device", "1", *FLAGS)
    try:
        expect_exit(ps, -signal.SIGKILL, tmp_path / "ps.log", TIMEOUT_S)
        killed_at = time.time()
        resumed_from = max((p for p in (run_root / "checkpoints").iterdir() if (p / LEDGER_FILE).is_file()),
                           key=lambda p: int(p.name.split("-")[1]))
        split = json.loads((resumed_from / LEDGER_FILE).read_text())["groups_done"]
        assert split, "the fault fires only after a checkpoint with a result partly trained"
        ps = start_process(run_root, tmp_path / "ps2.log", "ps", *FLAGS, "--dynamic_sampling")
        expect_exit(ps, 0, tmp_path / "ps2.log", TIMEOUT_S)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=120)
    assert [m["step"] for m in metrics(run_root)] == list(range(1, STEPS + 1))
    groups = assert_groups_exactly_once(run_root, STEPS)
    # The result split at the resumed checkpoint: the relaunched PS trained its other groups, not those done.
    relaunched = [e for e in ps_events(run_root, "result_consumed") if e["t"] > killed_at]
    for job, done in split.items():
        again = {g for e in relaunched if e["job_id"] == job for g in e["groups"]}
        assert again and not again & set(done), (job, done, again)
    # Zero-variance groups never trained: every trained group's rewards spread (the results hold them).
    assert groups["dropped"], "the binary task has groups all right or all wrong early on"
    spread = {}
    for path in (run_root / "done").iterdir():
        if done_reason(path.name).value == "consumed":
            payload = fileops.load_payload(path)
            rewards = payload["data"]["batch"]["rewards"].view(-1, 8)
            spread[payload["job_id"]] = rewards.max(dim=1).values - rewards.min(dim=1).values
    assert all(spread[job][g] > 0 for job, g in groups["trained"]), "a group without reward spread was trained"
    assert all(spread[job][g] == 0 for job, g in groups["dropped"] if job in spread)
    # Each step's metrics line counts the groups dropped while its batch was assembled, and their running total
    # (carried on across the restart); queue_tools ls shows both, and the report counts groups from the events.
    lines = metrics(run_root)
    assert lines[-1]["groups_dropped_total"] == sum(m["groups_dropped"] for m in lines) > 0
    ls = format_report(inspect_run(RunDir.open(run_root), 4))
    last = lines[-1]
    assert f"groups_dropped={last['groups_dropped']} groups_dropped_total={last['groups_dropped_total']}" in ls
    assert "done (files, by reason): " in ls  # files, not groups
    assert "filtered" in ls.splitlines()[-2]  # done: ... | filtered N
    report = make_report(RunDir.open(run_root))
    assert (report["groups"]["dropped"], report["groups"]["trained"]) == (len(groups["dropped"]),
                                                                          len(groups["trained"]))
    assert f"dynamic sampling: {len(groups['dropped'])} group(s) dropped" in format_text(report)
