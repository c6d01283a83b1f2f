"""Resuming at the edges: a PS relaunched on a run that already reached max_steps, a torn metrics line,
a PS killed while it saves."""

import json
import shutil
import signal
import subprocess
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    DEMO_RUN_FLAGS,
    PROCESS_ENV,
    PYTHON,
    REPO,
    RunProcesses,
    assert_exactly_once,
    expect_exit,
    run_flags,
    start_faulty_ps,
    start_process,
)
from safetensors.torch import load_file


@pytest.mark.process
def test_a_ps_relaunched_on_a_finished_run_trains_nothing_more(finished_demo_run, tmp_path):
    run_root = tmp_path / "run"
    shutil.copytree(finished_demo_run, run_root, ignore=shutil.ignore_patterns("report"))
    steps_before = (run_root / "metrics.jsonl").read_text()
    final_before = load_file(run_root / "final_model" / "model.safetensors")
    ps = subprocess.run([PYTHON, "-m", "ps", "--run_dir", str(run_root), *DEMO_RUN_FLAGS], cwd=REPO,
                        env=PROCESS_ENV, capture_output=True, text=True, timeout=600)
    assert ps.returncode == 0, ps.stderr[-3000:]
    assert "already reached max_steps=8: nothing to train" in ps.stderr
    assert "resumed with" not in ps.stderr  # the same flags: every one is recorded, none said
    assert (run_root / "metrics.jsonl").read_text() == steps_before
    assert sorted(p.name for p in (run_root / "checkpoints").glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]
    state = json.loads((run_root / "ps.json").read_text())
    assert (state["state"], state["global_step"]) == ("finished", 8)
    assert_exactly_once(run_root, jobs=8)  # the ledger, done/ and the jobs thrown: unchanged, nothing twice
    # The final model is saved again from the newest checkpoint, not from the untrained base.
    final_after = load_file(run_root / "final_model" / "model.safetensors")
    assert final_after.keys() == final_before.keys()
    assert all(torch.equal(final_after[name], final_before[name]) for name in final_before)


@pytest.mark.process
def test_a_ps_relaunched_on_a_damaged_checkpoint_says_which_file_and_what_to_do(finished_demo_run, tmp_path):
    """The newest checkpoint's weights cut short (a disk that failed, a copy that stopped): one line naming the
    file and the way on (exit 2: a relaunch would stop again), nothing changed in the run."""
    run_root = tmp_path / "run"
    shutil.copytree(finished_demo_run, run_root, ignore=shutil.ignore_patterns("report"))
    newest = run_root / "checkpoints" / "checkpoint-8"
    with open(newest / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    ps = subprocess.run([PYTHON, "-m", "ps", "--run_dir", str(run_root), *DEMO_RUN_FLAGS], cwd=REPO,
                        env=PROCESS_ENV, capture_output=True, text=True, timeout=600)
    assert ps.returncode == 2, ps.stderr[-3000:]
    assert ps.stderr.strip().splitlines()[-1] == (
        f"ps: error: {newest} is damaged (model.safetensors: SafetensorError: Error while deserializing header: "
        f"invalid header length): move it aside (mv {newest} {newest.parent / 'damaged-checkpoint-8'}) and relaunch "
        "to resume from checkpoint-6 (the steps after it are trained again)")
    assert sorted(p.name for p in newest.parent.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]
    assert json.loads((run_root / "ps.json").read_text())["state"] == "finished"
    assert_exactly_once(run_root, jobs=8)


@pytest.mark.process
@pytest.mark.parametrize("newest", ["checkpoint-6", "checkpoint-8"])
def test_a_run_by_epochs_resumes_to_its_last_epoch(finished_demo_run, tmp_path, newest):
    """With --max_steps -1 the run ends after --num_train_epochs: its relaunch took any checkpoint for the end of
    the run ("already reached max_steps=-1: nothing to train") and saved it as the final model. The demo's 1000
    prompts are 250 steps an epoch: 0.03 of an epoch is 8 steps, from checkpoint-6 two more, from checkpoint-8
    none."""
    run_root = tmp_path / "run"
    left_out = ["report"] if newest == "checkpoint-8" else ["report", "checkpoint-8"]
    shutil.copytree(finished_demo_run, run_root, ignore=shutil.ignore_patterns(*left_out))
    steps_before = (run_root / "metrics.jsonl").read_text()
    by_epochs = [*run_flags(None, save_steps=3), "--max_steps", "-1", "--num_train_epochs", "0.03"]
    with RunProcesses(run_root, *by_epochs) as run:
        run.ps()
        run.workers(1)
        run.expect_ps_exit(0)
    log = run.ps_log.read_text()
    assert "resuming from " + str(run_root / "checkpoints" / newest) in log
    assert ("already reached step 8, the end of its epochs: nothing to train" in log) == (newest == "checkpoint-8")
    steps = [json.loads(line)["step"] for line in (run_root / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
    if newest == "checkpoint-8":
        assert (run_root / "metrics.jsonl").read_text() == steps_before
    state = json.loads((run_root / "ps.json").read_text())
    assert (state["state"], state["global_step"], state["max_steps"]) == ("finished", 8, 8)  # (what workers read)
    assert_exactly_once(run_root, jobs=8)


@pytest.mark.process
def test_a_relaunch_trains_on_with_its_own_learning_rate_and_weight_decay(finished_demo_run, tmp_path):
    """torch's load_state_dict brought the checkpoint's hyperparameters back: a relaunch with --learning_rate 0.01
    said "it applies from the next step on" and trained on at the old rate (0.001) along the old schedule."""
    run_root = tmp_path / "run"
    shutil.copytree(finished_demo_run, run_root, ignore=shutil.ignore_patterns("report", "checkpoint-8"))
    with RunProcesses(run_root, *DEMO_RUN_FLAGS, "--learning_rate", "0.01", "--weight_decay", "0.5") as run:
        run.ps()
        run.workers(1)
        run.expect_ps_exit(0)
    assert "resumed with --learning_rate 0.01 where checkpoint-6 was trained with 0.001" in run.ps_log.read_text()

    def rates(run_dir):  # the learning rate of each step, from the run's last checkpoint
        state = json.loads((run_dir / "checkpoints" / "checkpoint-8" / "trainer_state.json").read_text())
        return {entry["step"]: entry["learning_rate"] for entry in state["log_history"] if "learning_rate" in entry}

    before, after = rates(finished_demo_run), rates(run_root)
    assert after[6] == before[6]  # trained before the relaunch
    for step in (7, 8):  # the same linear schedule, from ten times the base rate
        assert after[step] == pytest.approx(10 * before[step], rel=1e-6), (step, before, after)
    groups = torch.load(run_root / "checkpoints" / "checkpoint-8" / "optimizer.pt", weights_only=True)["param_groups"]
    assert sorted(group["weight_decay"] for group in groups) == [0.0, 0.5]  # (norms and biases: none, as TRL has it)
    assert {group["initial_lr"] for group in groups} == {0.01}


@pytest.mark.process
def test_a_longer_relaunch_of_a_finished_run_trains_on_its_own_schedule(finished_demo_run, tmp_path):
    """A finished run's linear schedule ends at 0: relaunched with --max_steps 10 and --learning_rate 0.01, its step 9
    trained at the old schedule's 0 (its factor kept), though the PS said the rate went on at 0.002."""
    run_root = tmp_path / "run"
    shutil.copytree(finished_demo_run, run_root, ignore=shutil.ignore_patterns("report"))
    flags = [*run_flags(10, save_steps=3), "--learning_rate", "0.01"]
    with RunProcesses(run_root, *flags) as run:
        run.ps()
        run.workers(1)
        run.expect_ps_exit(0)
    assert "the learning rate goes from 0.000125 (its last step's) to 0.002" in run.ps_log.read_text()
    state = json.loads((run_root / "checkpoints" / "checkpoint-10" / "trainer_state.json").read_text())
    rates = {entry["step"]: entry["learning_rate"] for entry in state["log_history"] if "learning_rate" in entry}
    assert [rates[9], rates[10]] == pytest.approx([0.01 * 2 / 10, 0.01 * 1 / 10], rel=1e-6), rates


def test_a_torn_metrics_line_is_removed_on_resume_and_the_rest_kept(run, caplog):
    # A PS killed while appending a step's line leaves it cut short, without its newline.
    from ps.trainer import AsyncGRPOTrainer

    lines = [json.dumps({"step": step, "reward": 0.5}) for step in (1, 2, 3, 4)]
    path = run.root / "metrics.jsonl"
    path.write_text("".join(f"{line}\n" for line in lines) + '{"step": 5, "rew')
    caplog.set_level("INFO", logger="asyncgrpo.ps")
    AsyncGRPOTrainer._forget_metrics_after(SimpleNamespace(run=run), 3)
    assert path.read_text() == "".join(f"{line}\n" for line in lines[:3])
    assert "1 line(s) of steps after 3 removed (they are trained again), 1 unreadable line(s) removed" in caplog.text
    # A run resumed without a checkpoint trains every step again: no "steps after 0".
    AsyncGRPOTrainer._forget_metrics_after(SimpleNamespace(run=run), 0)
    assert path.read_text() == "" and "3 line(s) of steps of a run without a checkpoint removed" in caplog.text


@pytest.mark.process
def test_a_ps_killed_between_a_checkpoint_and_its_ledger_resumes_from_the_one_before(tmp_path):
    # With --save_total_limit 1, transformers deletes checkpoint-2 as part of saving checkpoint-4: had it done so
    # before checkpoint-4's ledger, no complete checkpoint would be left and the relaunch would start from step 0.
    root = tmp_path / "run"
    flags = ["--run_dir", str(root), *run_flags(6, save_steps=2), "--save_total_limit", "1"]
    killed = start_faulty_ps(root, tmp_path / "ps.log", "kill-before-ledger", 4, *flags[2:])
    worker = start_process(root, tmp_path / "worker.log", "worker", "--device", "1", *flags[2:])
    try:
        expect_exit(killed, -signal.SIGKILL, tmp_path / "ps.log", 600)
        checkpoints = sorted(p.name for p in (root / "checkpoints").glob("checkpoint-*"))
        assert checkpoints == ["checkpoint-2", "checkpoint-4"]  # 4 without its ledger: incomplete
        relaunched = start_process(root, tmp_path / "ps2.log", "ps", *flags[2:])
        expect_exit(relaunched, 0, tmp_path / "ps2.log", 600)
    finally:
        for proc in (killed, worker):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
    assert "resuming from " + str(root / "checkpoints" / "checkpoint-2") in (tmp_path / "ps2.log").read_text()
    assert sorted(p.name for p in (root / "checkpoints").glob("checkpoint-*")) == ["checkpoint-6"]
    assert_exactly_once(root, jobs=6)


@pytest.mark.process
def test_the_model_card_names_the_local_model_it_was_trained_from(finished_demo_run):
    card = (finished_demo_run / "checkpoints" / "README.md").read_text()  # TRL's, written with each checkpoint
    demo_model = json.loads((finished_demo_run / "ps.json").read_text())["model"]
    assert f"This model is a fine-tuned version of `{demo_model}` (a local folder)" in card
    assert "[None]" not in card
