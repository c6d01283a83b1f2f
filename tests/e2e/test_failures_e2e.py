"""Failing reward functions, through real processes (tests/processes/reward_faults.py, loaded by import path).

- One that always raises: launch.sh exits 1 soon, its output names the
  function and the exception once, done/ holds a bounded number of files, and the workers back off
  between failures instead of spinning.
- One that raises on some prompts: those jobs are retried, then dropped; the run finishes, and the PS
  log, `queue_tools ls` (health WARN) and `queue_tools report` (diagnosis) say so.
- --log_completions: the PS prints TRL's completions table with the rows the workers generated.
"""

import json
import re
import subprocess
from collections import defaultdict
from pathlib import Path

import pandas as pd
import pytest
from helpers import (
    PROCESS_ENV,
    REPO,
    assert_exactly_once,
    demo_flags,
    expect_exit,
    kill_run,
    metrics,
    ps_events,
    run_flags,
    start_process,
)

from asyncgrpo.events import read_events
from asyncgrpo.jobqueue.names import ArchiveReason, done_reason
from asyncgrpo.run import fileops
from queue_tools.cli import main as queue_tools
from worker.loop import FAILURE_BACKOFF_MAX_S, FAILURE_BACKOFF_S

# The demo task with another reward.
DEMO_FLAGS = [*demo_flags(), "--seed", "0"]
LAUNCH_TIMEOUT_S = 300  # start-up included; on an idle 2-core machine the run stops within about 40 s
MAX_FAILED_IN_A_ROW, MAX_ATTEMPTS, MAX_OUTSTANDING = 8, 3, 16  # the defaults


def launch_until_it_stops(cwd, run_root, reward: str, stderr=subprocess.PIPE) -> tuple[int, str, str]:
    """launch.sh with 2 workers, the demo task scored by ``reward``, run from ``cwd`` until it stops by itself
    (killed, and the test failed, if it does not within LAUNCH_TIMEOUT_S): (status, stdout, stderr)."""
    launcher = subprocess.Popen(
        ["bash", str(REPO / "launch.sh"), "--workers", "2", "--run-dir", str(run_root), "--max-steps", "100",
         *DEMO_FLAGS, "--reward_funcs", reward],
        cwd=cwd, env=PROCESS_ENV, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        out, err = launcher.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_run(run_root, launcher)
        raise
    return launcher.returncode, out, err or ""


def done_by_reason(run_root) -> dict[str, list[str]]:
    by_reason = defaultdict(list)
    for name in (Path(run_root) / "done").iterdir():
        by_reason[done_reason(name.name).value].append(name.name)
    return by_reason


def worker_events(run_root) -> dict[int, list[dict]]:
    """Each worker process's events, by pid, in file order."""
    by_pid = defaultdict(list)
    for event in read_events(run_root, role="worker"):
        by_pid[event["pid"]].append(event)
    return by_pid


def test_a_reward_function_that_always_fails_stops_the_run_naming_it_once(tmp_path):
    # One that returns a reward too few fails in TRL's own check, and its job names it the same way: see
    # tests/test_trl_contract.py (test_a_failed_job_names_the_reward_function_from_trl_s_frames).
    reward, error = "always_raises", "reward function 'always_raises' raised RuntimeError: the reward server is down"
    run_root = tmp_path / "run"
    status, out, _ = launch_until_it_stops(REPO, run_root, f"tests.processes.reward_faults:{reward}",
                                           stderr=subprocess.STDOUT)
    assert status == 1, out
    # The terminal names the function and its exception as each worker first meets it (its repeats are counted
    # for a line a minute later, after the run has stopped), and in the PS's reason for stopping, once; no wait loop.
    lines = [line for line in out.splitlines() if error in line]
    workers = [line for line in lines if " WARNING [jobs] " in line]  # (the repeats' line too, on a slow machine)
    first = [line for line in workers if f"[jobs] a job failed: {error} (the first such failure" in line]
    assert 1 <= len(first) <= 2, lines  # a worker each
    [stop] = [line for line in lines if line not in workers]
    assert stop.startswith(f"ps: error: {MAX_FAILED_IN_A_ROW} jobs in a row failed on all {MAX_ATTEMPTS} attempt(s)")
    assert "has waited" not in out
    assert (f"the parameter server exited with status 1; workers stopped. No checkpoint was saved: a relaunch with "
            f"--run-dir {run_root} starts from the beginning.") in out, out
    # Nothing trained, and a bounded number of files: jobs stop being thrown while the failing ones are
    # retried (they stay in flight), and the run stops at the first MAX_FAILED_IN_A_ROW in a row.
    assert metrics(run_root) == []
    done = done_by_reason(run_root)
    assert set(done) <= {"retried", "processed", "failed"}, done.keys()
    thrown = len(ps_events(run_root, "job_created"))
    assert MAX_FAILED_IN_A_ROW <= len(done["failed"]) <= thrown <= MAX_FAILED_IN_A_ROW + MAX_OUTSTANDING
    assert len(done["retried"]) <= (MAX_ATTEMPTS - 1) * thrown
    errors = fileops.load_payload(run_root / "done" / sorted(done["failed"])[0])["data"]["errors"]
    assert [e["reward_function"] for e in errors] == [reward] * MAX_ATTEMPTS
    # No spinning: after its k-th failed generate call in a row (the jobs of one call, --jobs_per_generate, fail
    # together) a worker waits before it claims again.
    for events in worker_events(run_root).values():
        failures, claiming, failed = [], False, False  # the first failure of each call that failed
        for e in events:
            if e["event"] == "job_claimed" and not claiming:
                claiming, failed = True, False  # a call's claims come before any of its outcomes
            elif e["event"] == "job_failed":
                claiming = False
                if not failed:
                    failures.append(e["mono"])
                failed = True
        for k, (earlier, later) in enumerate(zip(failures, failures[1:], strict=False), start=1):
            assert later - earlier >= min(FAILURE_BACKOFF_MAX_S, FAILURE_BACKOFF_S * 2 ** (k - 1)) - 1e-3


def test_a_reward_function_that_applies_to_no_row_is_said_once_then_stops_the_run(tmp_path):
    """TRL's None (the function does not apply to that row) for every row: each step teaches nothing. The terminal
    says so once, every step's line still prints, and after NO_REWARD_STOP_STEPS such steps the run stops, naming
    the cause (it ran all 100 steps and exited 0 before, silently)."""
    from ps.learning_signal import NO_REWARD_STOP_STEPS

    run_root = tmp_path / "run"
    status, out, _ = launch_until_it_stops(REPO, run_root, "tests.processes.reward_faults:never_applies",
                                           stderr=subprocess.STDOUT)
    assert status == 1, out[-3000:]
    said = [line for line in out.splitlines() if "no reward: every reward function returned None" in line]
    assert said and " WARNING [train] step=1: no reward" in said[0], said  # (then at most once a minute)
    ps_log = (run_root / "logs" / "log_parameter_server.txt").read_text()
    assert len(re.findall(r" (INFO|STEP) \[train\] step=\d+ reward=- ", ps_log)) == NO_REWARD_STOP_STEPS
    assert re.search(r" INFO \[train\] step=1 reward=- ", out)  # (the terminal shows one step in a few)
    assert (f"ps: error: {NO_REWARD_STOP_STEPS} steps in a row without a reward: every reward function returned None "
            "(or NaN) for every completion") in out
    lines = metrics(run_root)
    assert [line["steps_without_reward"] for line in lines] == list(range(1, NO_REWARD_STOP_STEPS + 1))
    assert all(line["reward"] is None for line in lines)


# ---------------------------------------------------------------- a reward that raises on some prompts


@pytest.fixture(scope="module")
def flaky_run(tmp_path_factory) -> Path:
    """8 steps of a PS and two workers, scoring with raises_on_digit_0 (jobs holding the prompt "0:" raise)
    and --log_completions on.

    The PS takes results in job order (--consume_order fifo): the 4th job (the first to hold "0:", seed 0) is
    dropped after its 3 attempts before step 4 trains. Taking whichever result is ready, the PS trains the jobs
    after it during its attempts and the workers' back-off, measured up to step 4 of 8 before it was dropped:
    a slower retry would let the run end first (the job then archived ``unused``, and no job ``failed``)."""
    root = tmp_path_factory.mktemp("flaky") / "run"
    flags = [*demo_flags(), *run_flags(8, save_steps=4), "--disable_tqdm", "true", "--log_completions", "true",
             "--consume_order", "fifo", "--reward_funcs", "tests.processes.reward_faults:raises_on_digit_0"]
    ps = start_process(root, root.parent / "ps.log", "ps", *flags)
    workers = [start_process(root, root.parent / f"w{i}.log", "worker", "--device", str(i), *flags) for i in (1, 2)]
    try:
        expect_exit(ps, 0, root.parent / "ps.log", 600)
    finally:
        for worker in workers:
            worker.terminate()
        codes = [worker.wait(timeout=120) for worker in workers]
    assert codes == [0, 0], codes
    return root


def failed_job_ids(run_root) -> list[str]:
    return sorted(name[:10] for name in done_by_reason(run_root)["failed"])


def test_prompts_that_make_a_reward_raise_are_retried_then_dropped_and_the_run_goes_on(flaky_run):
    assert [m["step"] for m in metrics(flaky_run)] == list(range(1, 9))
    assert_exactly_once(flaky_run, jobs=8)
    failed = failed_job_ids(flaky_run)
    assert failed, "no job held the prompt '0:' (with seed 0 the 4th job does)"
    names = set(done_by_reason(flaky_run)["retried"]) | set(done_by_reason(flaky_run)["failed"])
    for job_id in failed:  # attempts 1 and 2 thrown again, the 3rd given up
        assert {f"{job_id}_retried.pt", f"{job_id}_retried_a2.pt", f"{job_id}_failed_a3.pt"} <= names
        payload = fileops.load_payload(flaky_run / "done" / f"{job_id}_failed_a3.pt")
        assert "0:" in [row["prompt"] for row in payload["data"]["job"]["rows"]]
        assert [(e["attempt"], e["type"], e["message"], e["reward_function"]) for e in payload["data"]["errors"]] == [
            (a, "ValueError", "cannot score the prompt '0:'", "raises_on_digit_0") for a in (1, 2, 3)]
    for path in (flaky_run / "done").glob("*_consumed.pt"):  # what was trained on never held "0:"
        assert "0:" not in [row["prompt"] for row in fileops.load_payload(path)["data"]["rows"]]


def test_the_ps_log_says_how_many_prompts_were_dropped(flaky_run):
    log = (flaky_run.parent / "ps.log").read_text().splitlines()
    drops = [i for i, line in enumerate(log) if "are not trained on" in line]
    n = len(failed_job_ids(flaky_run))
    assert len(drops) == n
    assert all(" WARNING [jobs] job " in log[i] for i in drops)  # (what launch.sh shows on the terminal)
    assert log[drops[-1]].endswith(f"(reward function 'raises_on_digit_0' raised ValueError: cannot score the prompt "
                                   f"'0:'): its 4 prompt(s) are not trained on; {n} job(s), {4 * n} prompt(s) "
                                   "dropped so far")
    # Every [train] line once a job was dropped shows the count of prompts dropped so far. The result collector
    # (a thread) raises the count just before it logs the drop, while the trainer reads it for its [train] line: a
    # line written between the two shows a drop logged after it, and one whose count was read just before a drop
    # logged ahead of it misses that drop. So a line's count lies between the drops logged before the [train]
    # line before it and those logged before the one after it: exactly the drops before it, unless one is logged
    # next to it.
    train = [i for i, line in enumerate(log) if "[train] step=" in line and "reward=" in line]
    assert len(train) == 8
    for previous, i, following in zip([-1, *train], train, [*train[1:], len(log)], strict=False):
        shown = re.search(r" dropped_prompts=(\d+)", log[i])
        shown = int(shown[1]) if shown else 0
        least, most = sum(d < previous for d in drops), sum(d < following for d in drops)
        assert 4 * least <= shown <= 4 * most, (least, most, log[i])


def test_queue_tools_ls_warns_with_the_count_and_the_last_error(flaky_run, capsys):
    assert queue_tools(["ls", str(flaky_run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    n = len(failed_job_ids(flaky_run))
    assert report["done"]["failed"] == n
    assert report["health"].startswith(
        f"WARN: {n} job(s) failed on every attempt and were not trained on (last error: reward function "
        "'raises_on_digit_0' raised ValueError: cannot score the prompt '0:')")


def test_queue_tools_report_names_the_dropped_jobs_in_its_diagnosis(flaky_run, capsys):
    assert queue_tools(["report", str(flaky_run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    n = len(failed_job_ids(flaky_run))
    assert report["dropped"] == {"jobs": n, "prompts": 4 * n, "last_error": "reward function 'raises_on_digit_0' "
                                 "raised ValueError: cannot score the prompt '0:'"}
    assert f"; {n} job(s) ({4 * n} prompts) failed on every attempt and were not trained on (last error: reward " \
           "function 'raises_on_digit_0' raised ValueError: cannot score the prompt '0:')" in report["diagnosis"]
    assert report["archived"][ArchiveReason.FAILED.value] == n


def test_log_completions_prints_trls_table_with_the_rows_the_workers_generated(flaky_run):
    consumed_at = {e["step"]: e["job_id"] for e in ps_events(flaky_run, "result_consumed")}
    for step in range(1, 9):  # TRL's log() writes each step's table as a parquet file too
        table = pd.read_parquet(flaky_run / "checkpoints" / "completions" / f"completions_{step:05d}.parquet")
        batch = fileops.load_payload(flaky_run / "done" / f"{consumed_at[step]}_consumed.pt")["data"]
        assert list(table["prompt"]) == [row["prompt"] for row in batch["rows"]]
        assert list(table["advantage"]) == pytest.approx(batch["batch"]["advantages"].tolist())
        assert list(table.columns) == ["step", "prompt", "completion", "raises_on_digit_0", "advantage"]
    log = (flaky_run.parent / "ps.log").read_text()
    tables = re.findall(r"─ Step (\d+) ─", log)  # TRL prints it at each logged step, and again at the end
    assert set(tables) == {str(step) for step in range(1, 9)}
    assert log.count("┃ Prompt ┃ Completion ┃ raises_on_digit_0 ┃ Advantage ┃") == len(tables)
    assert len(re.findall(r"^│ │ \d:\s+│", log, flags=re.MULTILINE)) == 32 * len(tables)  # every row, every time


# A reward module whose dependency exists on the trainer's host only: the PS (and launch.sh's input check)
# imports it; every worker fails to, and exits 2 (bad input).
PS_HOST_ONLY_REWARDS = '''\
import sys

if "worker" in sys.argv[0]:
    raise ImportError("No module named 'judge_client'")


def ones(prompts, completions, **kwargs):
    return [1.0] * len(completions)
'''


def test_workers_that_exit_with_bad_input_are_not_restarted_and_the_run_stops_with_their_reason(tmp_path):
    (tmp_path / "host_rewards.py").write_text(PS_HOST_ONLY_REWARDS)
    run_root = tmp_path / "run"
    status, out, err = launch_until_it_stops(tmp_path, run_root, "host_rewards:ones")
    assert status == 2, out + err
    assert err.strip().splitlines()[-1] == ("worker: error: --reward_funcs 'host_rewards:ones': cannot import "
                                            "host_rewards: No module named 'judge_client'")
    assert out.count("exited with status 2, bad input: not restarted") == 2, out
    assert "restarting it" not in out
    assert "stopping the parameter server" in out
    assert metrics(run_root) == []
