"""A `trl grpo` command line carries over: TRL's ModelConfig and ScriptArguments flags, with TRL's
names, defaults and meaning, reach the model and dataset loaders of the PS and the workers;
--eval_strategy runs TRL's evaluation on the PS; the final model is saved where trl grpo saves it
(--output_dir), or in the run, with or without checkpoints.

The launch.sh tests share one real run from a user's folder (tests/helpers/configs.py write_user_folder):
a PS and one worker, relative paths, 2 steps."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, launch_sh, modes_beyond, newest_checkpoint, open_as_nobody, read_json, write_user_folder
from safetensors.torch import load_file
from trl import ModelConfig, ScriptArguments

from asyncgrpo.config import ConfigError
from asyncgrpo.config_parser import parse_config
from asyncgrpo.events import read_events
from asyncgrpo.inputs import load_eval_dataset, load_model_and_tokenizer, load_reward_funcs, load_train_dataset
from asyncgrpo.tasks.demo import write_demo_model

TRL_FLAGS = {ModelConfig: ("model_revision", "dtype", "attn_implementation"),
             ScriptArguments: ("dataset_config", "dataset_train_split", "dataset_test_split")}


def parse(*argv: str):
    return parse_config(["--device_type", "cpu", *argv])


# ---------------------------------------------------------------------- flags, in process

def test_trl_model_and_dataset_flags_parse_with_trls_defaults():
    cfg = parse()
    for owner, names in TRL_FLAGS.items():
        defaults = {f.name: f.default for f in dataclasses.fields(owner)}
        for name in names:
            assert getattr(cfg, name) == defaults[name], f"--{name}: {getattr(cfg, name)!r}, TRL's {defaults[name]!r}"
    cfg = parse("--model_revision", "v2", "--dtype", "bfloat16", "--attn_implementation", "eager",
                "--trust_remote_code", "true", "--dataset_config", "small", "--dataset_train_split", "a",
                "--dataset_test_split", "b", "--model_init_kwargs", '{"low_cpu_mem_usage": true}')
    assert (cfg.model_revision, cfg.dtype, cfg.attn_implementation, cfg.trust_remote_code) == ("v2", "bfloat16",
                                                                                            "eager", True)
    assert (cfg.dataset_config, cfg.dataset_train_split, cfg.dataset_test_split) == ("small", "a", "b")
    assert cfg.model_init_kwargs == {"low_cpu_mem_usage": True}


def test_older_flag_names_are_aliases():
    assert parse("--torch_dtype", "float16").dtype == "float16"
    cfg = parse("--dataset_split", "validation")
    assert cfg.dataset_train_split == cfg.dataset_split == "validation"
    with pytest.raises(ConfigError, match="give one of them"):
        parse("--torch_dtype", "float16", "--dtype", "bfloat16")
    with pytest.raises(ConfigError, match="--model_init_kwargs"):
        parse("--model_init_kwargs", "{not json")


@pytest.mark.parametrize("flags, dtype, attention", [
    ([], torch.float32, "sdpa"),
    (["--dtype", "bfloat16"], torch.bfloat16, "sdpa"),
    (["--torch_dtype", "float16"], torch.float16, "sdpa"),
    (["--model_init_kwargs", '{"dtype": "bfloat16"}'], torch.bfloat16, "sdpa"),
    (["--attn_implementation", "eager"], torch.float32, "eager"),
    (["--dtype", "auto"], torch.bfloat16, "sdpa"),  # as saved
])
def test_the_model_loads_as_the_flags_say(tmp_path, flags, dtype, attention):
    path = tmp_path / "model"
    write_demo_model(path)
    model, _ = load_model_and_tokenizer(str(path))
    model.to(torch.bfloat16).save_pretrained(path)  # saved in bfloat16: 'auto' keeps that, float32 (TRL's default) not
    cfg = parse("--model_name_or_path", str(path), *flags)
    model, tokenizer = load_model_and_tokenizer(str(path), cfg)
    assert model.dtype == dtype and model.config._attn_implementation == attention
    assert tokenizer.pad_token is not None
    # TRL builds its reference model (--beta > 0) from model_init_kwargs: the same dtype, on one device
    assert cfg.model_init_kwargs["dtype"] == str(dtype).removeprefix("torch.")
    assert cfg.model_init_kwargs["device_map"] is None


def test_dataset_config_and_splits_select_what_trl_would(tmp_path):
    folder = tmp_path / "ds"
    for config, prompts in {"small": ["s:"], "big": ["b:", "c:"]}.items():
        (folder / config).mkdir(parents=True)
        for split in ("train", "test"):
            (folder / config / f"{split}.jsonl").write_text(
                "".join(json.dumps({"prompt": f"{split}-{p}"}) + "\n" for p in prompts))
    (folder / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train.jsonl\n"
        f"  - split: test\n    path: {c}/test.jsonl\n" for c in ("small", "big")) + "---\n")
    cfg = parse("--dataset_name", str(folder), "--dataset_config", "big")
    assert load_train_dataset(cfg)["prompt"] == ["train-b:", "train-c:"]
    assert load_eval_dataset(cfg) is None  # no --eval_strategy: no evaluation
    cfg = parse("--dataset_name", str(folder), "--dataset_config", "small", "--dataset_train_split", "test",
                "--dataset_test_split", "train", "--eval_strategy", "steps")
    assert load_train_dataset(cfg)["prompt"] == ["test-s:"]
    assert load_eval_dataset(cfg)["prompt"] == ["train-s:"]


MIXTURE_YAML = """\
datasets:
  - path: json
    data_files: a.jsonl
    fraction: 0.75
  - path: json
    data_files: b.jsonl
    columns: [prompt]
    fraction: 0.25
test_split_size: 0.25
"""


def test_a_dataset_mixture_in_the_yaml_file_is_what_trls_get_dataset_makes(tmp_path, monkeypatch):
    """TRL's --datasets mixture: relative data_files from the user's folder, fractions, columns and the test split
    as trl grpo's get_dataset makes them; the demo's defaults stay off; TRL's refusals (a streamed mixture with
    fractions) in one line."""
    from trl import DatasetMixtureConfig, get_dataset

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"prompt": f"a{i}:", "level": i}) + "\n" for i in range(30)))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"prompt": f"b{i}:", "level": i}) + "\n" for i in range(30)))
    (tmp_path / "mix.yaml").write_text(MIXTURE_YAML)
    cfg = parse("--config", "mix.yaml", "--eval_strategy", "steps", "--seed", "3")
    assert cfg.learning_rate != 1e-3, "a mixture is the user's data: the demo's defaults are off"
    expected = get_dataset(DatasetMixtureConfig(datasets=[
        {"path": "json", "data_files": "a.jsonl", "fraction": 0.75},
        {"path": "json", "data_files": "b.jsonl", "columns": ["prompt"], "fraction": 0.25}], test_split_size=0.25))
    train, test = list(load_train_dataset(cfg)["prompt"]), list(load_eval_dataset(cfg)["prompt"])
    assert sorted(train + test) == sorted(list(expected["train"]["prompt"]) + list(expected["test"]["prompt"]))
    assert train == list(load_train_dataset(cfg)["prompt"]), "every load (each process) splits alike"
    assert len(train) + len(test) == 40 and len(test) == 10  # 30 of a, 10 of b (fractions 3:1), a quarter held out
    assert sum(p.startswith("b") for p in train + test) == 10
    streamed = parse("--config", "mix.yaml", "--streaming", "true", "--max_steps", "5")
    with pytest.raises(ConfigError, match="^--datasets: cannot load the mixture: .*fraction.* not supported with "
                                          "streaming"):  # TRL's own refusal, in one line
        load_train_dataset(streamed)
    with pytest.raises(ConfigError, match="^--dataset_streaming: give --max_steps: a streamed dataset has no length"):
        parse("--dataset_name", "a.jsonl", "--dataset_streaming", "true")


def test_reward_functions_import_from_the_current_folder_in_trls_spellings(tmp_path, monkeypatch):
    write_user_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    funcs = load_reward_funcs(parse("--reward_funcs", "rewards:ones", "rewards.ones", "think_format_reward"))
    assert [f.__name__ for f in funcs] == ["ones", "ones", "think_format_reward"]
    assert funcs[0](["1:"], ["11a1"]) == [0.75]


# ---------------------------------------------------------------------- a real run from the user's folder

RUN_YAML = """\
per_device_train_batch_size: 4
per_device_eval_batch_size: 4
num_generations: 4
max_completion_length: 4
logging_steps: 1
learning_rate: 0.001
gradient_checkpointing: false
report_to: none
lease_s: 5
seed: 0
"""


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory):
    """``bash launch.sh`` from a user's folder with a `trl grpo` command line, relative paths only: a PS and a
    worker, 2 steps, --dtype bfloat16, evaluation every step, --output_dir out, no checkpoints, the run shared
    with its group. The folder also holds a ps.py that must not shadow the parameter server."""
    folder = write_user_folder(tmp_path_factory.mktemp("user"))
    (folder / "run.yaml").write_text(RUN_YAML)
    (folder / "ps.py").write_text("raise SystemExit('the user folder shadowed the ps package')\n")
    result = launch_sh(folder, "--workers", "1", "--max-steps", "2", "--run-dir", "runs/trl", "--config", "run.yaml",
                       "--model_name_or_path", "mymodel", "--dataset_name", "data", "--reward_funcs", "rewards:ones",
                       "--dtype", "bfloat16", "--eval_strategy", "steps", "--eval_steps", "1", "--output_dir", "out",
                       "--save_strategy", "no", "--share_with_group")
    run_root = folder / "runs" / "trl"
    logs = {name: (run_root / "logs" / name).read_text() if (run_root / "logs" / name).exists() else ""
            for name in ("log_parameter_server.txt", "log_worker_1.txt")}
    assert result.returncode == 0, (
        f"{result.stdout[-2000:]}\n{result.stderr}\n{logs['log_parameter_server.txt'][-3000:]}")
    return folder, run_root, logs


@pytest.mark.process
def test_share_with_group_opens_every_file_of_the_run_to_its_group_and_nobody_else(trl_run):
    _, run_root, _ = trl_run
    assert modes_beyond(run_root, 0o770) == []  # nothing for other users
    paths = [run_root, *run_root.rglob("*")]
    assert [p for p in paths if p.is_file() and p.stat().st_mode & 0o060 != 0o060] == []
    # setgid: what a member of the group creates inside belongs to the run's group too
    assert [p for p in paths if p.is_dir() and p.stat().st_mode & 0o2070 != 0o2070] == []
    assert open_as_nobody(run_root / "logs", "launch.txt", groups=(run_root.stat().st_gid,))
    assert not open_as_nobody(run_root / "logs", "launch.txt")


@pytest.mark.process
def test_dtype_applies_on_the_ps_and_the_worker(trl_run):
    folder, _, logs = trl_run
    for name, text in logs.items():
        assert f"[model] loaded {folder / 'mymodel'}: dtype=bfloat16" in text, f"{name}:\n{text[-2000:]}"
    assert {t.dtype for t in load_file(folder / "out" / "model.safetensors").values()} == {torch.bfloat16}


@pytest.mark.process
def test_evaluation_runs_on_the_ps_with_the_test_split(trl_run):
    folder, run_root, logs = trl_run
    assert "[eval] step=1 " in logs["log_parameter_server.txt"] and "[eval] step=2 " in logs["log_parameter_server.txt"]
    # Said as it starts (training waits for it), then its result: both lines reach the terminal (launch.sh's filter).
    started = logs["log_parameter_server.txt"].index(
        "INFO [eval] step=1 evaluating 2 prompts on the parameter server's model: training resumes after it")
    assert started < logs["log_parameter_server.txt"].index("INFO [eval] step=1 reward=")
    callers = set((folder / "reward_calls.txt").read_text().split())
    ps_pid, worker_pid = read_json(run_root / "ps.json")["pid"], read_json(run_root / "workers" / "dev1.json")["pid"]
    assert callers == {str(ps_pid), str(worker_pid)}  # the PS scored its evaluation, the worker its jobs
    # Its metrics in metrics.jsonl (TRL's eval_* names), apart from the steps' lines; its time a span of its own.
    from asyncgrpo.run import metrics

    evals = metrics.read_lines(run_root / "metrics.jsonl", kind="eval")
    assert [e["step"] for e in evals] == [1, 2] and all("eval_loss" in e and "eval_reward" in e for e in evals)
    steps = metrics.read_lines(run_root / "metrics.jsonl")
    assert [line["step"] for line in steps] == [1, 2]
    # Every metric TRL logged for a step is in its line: per reward function, KL, lengths, the learning rate.
    assert {"rewards/ones/mean", "rewards/ones/std", "completions/mean_length", "learning_rate"} <= \
        steps[0]["trl"].keys(), steps[0]
    assert steps[0]["trl"]["rewards/ones/mean"] == steps[0]["reward"] and "staleness/mean" not in steps[0]["trl"]
    assert [e["step"] for e in read_events(run_root, process="ps", event="eval_end")] == [1, 2]


@pytest.mark.process
def test_the_final_model_is_saved_to_output_dir_even_without_checkpoints(trl_run):
    folder, run_root, _ = trl_run
    out = folder / "out"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert read_json(run_root / "ps.json")["final_model"] == str(out)
    assert not list((run_root / "checkpoints").glob("checkpoint-*"))  # --save_strategy no
    model, _ = load_model_and_tokenizer(str(out))  # loads back as trl grpo's output would
    assert model.num_parameters() > 0


@pytest.mark.process
def test_the_final_model_lands_in_the_run_without_output_dir(finished_demo_run):
    """The shared demo run (tests/conftest.py) gave no --output_dir: RUN/final_model holds the model of its last
    step, which its last checkpoint (step 8) holds too."""
    final = finished_demo_run / "final_model"
    assert (final / "tokenizer.json").is_file()
    saved = load_file(final / "model.safetensors")
    checkpoint = load_file(newest_checkpoint(finished_demo_run) / "model.safetensors")
    assert saved.keys() == checkpoint.keys() and all(torch.equal(saved[k], checkpoint[k]) for k in saved)


@pytest.mark.process
def test_relative_paths_resolve_in_the_users_folder(trl_run):
    folder, run_root, _ = trl_run
    assert run_root.is_dir() and not (REPO / "runs" / "trl").exists()  # --run-dir runs/trl: not in the source tree
    assert (folder / "reward_calls.txt").exists()  # rewards:ones from rewards.py next to the user
    lines = [json.loads(line) for line in (run_root / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if m.get("kind") != "eval"] == [1, 2]  # (and an evaluation's line a step)
    assert Path(read_json(run_root / "ps.json")["model"]) == folder / "mymodel"


def test_trl_does_not_claim_the_applied_model_init_kwargs_were_ignored(tmp_path, caplog):
    """TRL warns that model_init_kwargs are ignored when handed a loaded model; here they were applied."""
    from worker.generate import build_trainer

    write_demo_model(tmp_path / "model")
    cfg = parse("--model_name_or_path", str(tmp_path / "model"), "--output_dir", str(tmp_path / "out"),
                "--model_init_kwargs", '{"dtype": "bfloat16"}', "--per_device_train_batch_size", "4",
                "--num_generations", "4", "--report_to", "none")
    model, tokenizer = load_model_and_tokenizer(str(tmp_path / "model"), cfg)
    with caplog.at_level(logging.WARNING):
        build_trainer(cfg, model, tokenizer, load_reward_funcs(cfg), load_train_dataset(cfg))
    assert model.dtype == torch.bfloat16
    assert not [r for r in caplog.records if "model_init_kwargs" in r.getMessage()], caplog.text
