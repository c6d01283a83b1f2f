"""One job, several optimizer steps (``--num_iterations 2``), with a real PS and worker.

Every step is logged with its own staleness, a job enters the ledger once its last step
has trained, checkpoints fall between jobs only, and a PS killed inside a job resumes
exactly: its final weights equal those of a run that was never interrupted.

Synchronous mode (``--max_staleness 0``) with one worker makes both runs deterministic:
each job is generated with the weights of the step that takes it, and sampled with the
job's own seed.
"""

import os
from pathlib import Path

import pytest
from helpers import (
    PROCESS_ENV,
    REPO,
    RunProcesses,
    assert_exactly_once,
    consumed_in_done,
    ledger,
    metrics,
    run_flags,
)
from safetensors.torch import load_file

from asyncgrpo.events import read_events

TIMEOUT_S = 600
FLAGS = ["--num_iterations", "2", "--max_staleness", "0", "--save_total_limit", "10", *run_flags(8, save_steps=3)]
KILL_AFTER_STEP = 5  # the first of job 3's two steps


def run_ps_and_worker(run_root: Path, ps_status: int, ps_env=None) -> None:
    """Runs the PS to its end (or death: ``ps_status``) with one worker, which then stops cleanly."""
    with RunProcesses(run_root, *FLAGS) as run:
        run.ps(env=ps_env)
        worker = run.worker(1)
        run.expect_ps_exit(ps_status, TIMEOUT_S)
        assert run.stop([worker]) == [0]


def thrown(run_root: Path) -> list[str]:
    return [e["job_id"] for e in read_events(run_root, event="job_created")]


def final_weights(run_root: Path) -> dict:
    return load_file(str(run_root / "checkpoints" / "checkpoint-8" / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run_root = tmp_path_factory.mktemp("uninterrupted") / "run"
    run_ps_and_worker(run_root, 0)
    return run_root


@pytest.mark.process
def test_each_step_is_logged_with_its_own_staleness_and_jobs_enter_the_ledger_whole(uninterrupted):
    lines = metrics(uninterrupted)
    assert [m["step"] for m in lines] == list(range(1, 9))
    # Four jobs, each generated with the weights of the step that takes it, trained two steps.
    assert [m["staleness_max"] for m in lines] == [0, 1] * 4
    assert [m["weights_version"] for m in lines] == [0, 0, 2, 2, 4, 4, 6, 6]
    assert all(m["reward"] is not None for m in lines)
    jobs = thrown(uninterrupted)[:4]  # a fifth may be thrown after step 8, and archived unused
    assert sorted(consumed_in_done(uninterrupted)) == sorted(jobs)
    # save_steps 3: the save at step 3 (inside job 2) waits for step 4; 6 falls between jobs; 8 is the end.
    folders = sorted(int(p.name.split("-")[1]) for p in (uninterrupted / "checkpoints").glob("checkpoint-*"))
    assert folders == [4, 6, 8]
    assert ledger(uninterrupted, step=4) == sorted(jobs[:2]) and ledger(uninterrupted, step=8) == sorted(jobs)
    assert_exactly_once(uninterrupted, jobs=4)  # ledger, done/ and thrown jobs agree, no job id twice


@pytest.mark.process
def test_a_ps_killed_inside_a_job_resumes_to_the_same_weights(uninterrupted, tmp_path):
    """Killed right after step 5 (job 3 half trained), the PS resumes from checkpoint-4: job 3's
    result comes back from done/ and trains both its steps again."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "# asyncgrpo.forkserver: runs in a fork too\n"
        "import os, signal\n"
        "from ps import trainer\n"
        "_step_end = trainer.AsyncGRPOTrainer.on_optimizer_step_end\n"
        "def on_optimizer_step_end(self):\n"
        "    _step_end(self)\n"
        f"    if self.state.global_step == {KILL_AFTER_STEP}:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "trainer.AsyncGRPOTrainer.on_optimizer_step_end = on_optimizer_step_end\n")
    run_root = tmp_path / "run"
    killed_env = {**PROCESS_ENV, "PYTHONPATH": os.pathsep.join([str(inject), str(REPO)])}
    run_ps_and_worker(run_root, -9, killed_env)
    assert (run_root / "global_step.txt").read_text().strip() == str(KILL_AFTER_STEP)  # killed before its log line
    assert [m["step"] for m in metrics(run_root)] == list(range(1, KILL_AFTER_STEP))
    assert len(consumed_in_done(run_root)) == 3 and len(ledger(run_root, step=4)) == 2  # job 3: taken, not in a ledger

    run_ps_and_worker(run_root, 0)
    assert [m["step"] for m in metrics(run_root)][KILL_AFTER_STEP - 1:] == list(range(5, 9))  # resumed at 4
    assert ledger(run_root, step=8) == sorted(consumed_in_done(run_root)) == sorted(consumed_in_done(uninterrupted))
    assert_exactly_once(run_root, jobs=4)  # job 3, trained again after the resume, is consumed once
    expected, weights = final_weights(uninterrupted), final_weights(run_root)
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert tensor.abs().sum() > 0
        assert weights[name].equal(tensor), name
