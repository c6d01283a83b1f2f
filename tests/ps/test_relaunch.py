"""Relaunching a run: with other flags than its checkpoint was trained with (ps/flag_changes.py), each change said
in one line, from and to, and a change of the jobs' row layout refused, naming the values to relaunch with; after
Ctrl-C, the PS says which steps a relaunch trains again."""

import json
import logging
import re

import pytest
from helpers import PYTHON, demo_config

from asyncgrpo.config import ConfigError
from ps.flag_changes import recorded_flags, say_or_refuse_changes


def test_each_changed_flag_is_said_in_one_line(tmp_path, caplog):
    saved = recorded_flags(demo_config(tmp_path, temperature=1.0, learning_rate=1e-3, max_attempts=5,
                                       top_entropy_quantile=1.0))
    cfg = demo_config(tmp_path, temperature=0.7, learning_rate=5e-4, max_attempts=2, top_entropy_quantile=0.2)
    with caplog.at_level(logging.INFO, logger="asyncgrpo.ps"):
        say_or_refuse_changes(saved, cfg, "/run/checkpoints/checkpoint-40")
    assert sorted(r.getMessage() for r in caplog.records) == sorted([
        "[train] resumed with --temperature 0.7 where checkpoint-40 was trained with 1.0: it applies to every job "
        "generated from now on, those already thrown too",
        "[train] resumed with --learning_rate 0.0005 where checkpoint-40 was trained with 0.001: it applies from the "
        "next step on",
        "[train] resumed with --top_entropy_quantile 0.2 where checkpoint-40 was trained with 1.0: it applies from "
        "now on",
        "[train] resumed with --max_attempts 2 where checkpoint-40 was trained with 5: it applies from now on, to the "
        "jobs already thrown too"])


def test_every_flag_is_recorded_but_credentials_and_where_the_run_is():
    import dataclasses

    from asyncgrpo.config import AsyncGRPOConfig

    cfg = demo_config("/tmp/x", hub_token="hf_secret", model_init_kwargs={"token": "hf_secret2", "revision": "main"})
    recorded = recorded_flags(cfg)
    assert "hf_secret" not in json.dumps(recorded)  # (the second too)
    assert recorded["model_init_kwargs"] == {"revision": "main"}
    names = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    assert {"average_tokens_across_devices", "gradient_checkpointing"} <= set(recorded)
    assert set(recorded) == names - {"max_steps", "run_dir", "output_dir", "final_model_dir", "hub_token"}


@pytest.mark.parametrize(("flag", "before", "after"),
                         [("num_generations", 8, 4), ("per_device_train_batch_size", 32, 16)])
def test_a_change_of_the_jobs_rows_is_refused(tmp_path, flag, before, after):
    saved = recorded_flags(demo_config(tmp_path, **{flag: before}))
    with pytest.raises(ConfigError, match=rf"^--{flag} {after} \(checkpoint-40 was trained with {before}\): the jobs "
                                          r"this run has thrown hold rows for its group size and batch"):
        say_or_refuse_changes(saved, demo_config(tmp_path, **{flag: after}), "/run/checkpoints/checkpoint-40")


@pytest.mark.parametrize(("flags", "before", "after"), [
    ({"lora_alpha": 16}, {"lora_alpha": 32}, "--lora_alpha 32 (checkpoint-4 was trained with 16)"),
    ({"lora_r": 8}, {"lora_r": 16}, "--lora_r 16 (checkpoint-4 was trained with 8)"),
    ({}, {"use_peft": False}, "--use_peft False (checkpoint-4 was trained with True)"),
    ({"lora_target_modules": ["q_proj", "v_proj"]}, {"lora_target_modules": ["q_proj", "v_proj", "k_proj"]},
     "--lora_target_modules ['q_proj', 'v_proj', 'k_proj'] (checkpoint-4 was trained with ['q_proj', 'v_proj'])"),
])
def test_a_change_of_what_the_lora_adapter_is_made_of_is_refused(tmp_path, flags, before, after):
    """Another --lora_alpha went on training the adapter at another scale, silently ("applies from now on");
    another --lora_r or target list, or --use_peft false, failed on loading the checkpoint with an error naming the
    model or the optimizer, and launch.sh offered the same relaunch again."""
    lora = {"use_peft": True, **flags}
    saved = recorded_flags(demo_config(tmp_path, **lora))
    with pytest.raises(ConfigError, match=r"^" + re.escape(after) + ": the run's checkpoints hold a LoRA adapter"):
        say_or_refuse_changes(saved, demo_config(tmp_path, **{**lora, **before}), "/run/checkpoints/checkpoint-4")
    # Without an adapter, its flags are nobody's.
    say_or_refuse_changes(recorded_flags(demo_config(tmp_path, lora_alpha=16)), demo_config(tmp_path, lora_alpha=8),
                          "/run/checkpoints/checkpoint-4")


def test_the_same_flags_or_a_checkpoint_that_recorded_none_say_nothing(tmp_path, caplog):
    cfg = demo_config(tmp_path)
    with caplog.at_level(logging.INFO, logger="asyncgrpo.ps"):
        say_or_refuse_changes(recorded_flags(cfg), cfg, "checkpoint-3")
        say_or_refuse_changes(None, cfg, "checkpoint-3")
    assert caplog.records == []


@pytest.mark.process
def test_a_ps_relaunched_with_another_group_size_stops_before_training_and_says_why(finished_demo_run, tmp_path):
    """A real PS, relaunched on (a copy of) a finished 8-step run with --num_generations 4: exit 2, one line, and
    nothing of the run changed (it trained every step before, regrouping the jobs' rows across prompts)."""
    import shutil
    import subprocess

    from helpers import DEMO_RUN_FLAGS, PROCESS_ENV, REPO

    run = tmp_path / "run"
    shutil.copytree(finished_demo_run, run, ignore=shutil.ignore_patterns("*.lock"))
    before = (run / "ps.json").read_text()
    argv = [PYTHON, "-m", "ps", "--run_dir", str(run), *DEMO_RUN_FLAGS, "--num_generations", "4"]
    done = subprocess.run(argv, cwd=REPO, env=PROCESS_ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "ps: error: --num_generations 4 (checkpoint-8 was trained with 8): the jobs this run has thrown hold rows for "
        "its group size and batch, which cannot change within a run; relaunch with the run's values, or start a new "
        "run with another --run_dir")
    assert (run / "ps.json").read_text() == before


def test_an_interrupted_ps_says_which_steps_a_relaunch_trains_again(run):
    from asyncgrpo.run.checkpoints import write_ledger
    from ps.__main__ import resume_line

    assert resume_line(run) == "no step trained yet: a relaunch with the same --run_dir starts from the beginning"
    run.write_global_step(137)
    assert resume_line(run).startswith("trained 137 step(s), no checkpoint saved yet: a relaunch with the same "
                                       "--run_dir starts from the beginning")
    (run.checkpoints / "checkpoint-100").mkdir(parents=True)
    write_ledger(run.checkpoints / "checkpoint-100", 100, {"consumed": []})
    assert resume_line(run).startswith("trained 137 step(s), the last checkpoint is of step 100: relaunch with the "
                                       "same --run_dir to resume there (steps 101-137 are trained again;")
    run.write_global_step(100)
    assert resume_line(run).startswith("trained 100 step(s), all saved")
