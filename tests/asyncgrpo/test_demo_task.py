"""The built-in demo task (asyncgrpo.tasks.demo): reward, offline tokenizer and model, dataset, TRL wiring."""

from __future__ import annotations

import collections
import dataclasses
import re

import pytest
import torch
from helpers import demo_config
from transformers import TrainerCallback

from asyncgrpo.tasks.demo import (
    DEMO_DEFAULTS,
    build_dataset,
    build_model,
    build_tokenizer,
    cpu_overrides,
    first_digit_reward,
    repeat_digit_reward,
    write_demo_model,
)


class _RewardLogs(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.logs.append(dict(logs))


def _state_dicts_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_reward_values():
    prompts = ["7:", "7:", "7:", "7:", "3:", "0:", "9:"]
    completions = ["7777", "7a7b", "", "1111", "3", "0000:000", "99 9"]
    assert repeat_digit_reward(prompts, completions) == [1.0, 0.5, 0.0, 0.0, 1.0, 0.875, 0.75]


def test_reward_accepts_trl_kwargs_and_conversational_completions():
    out = repeat_digit_reward(
        prompts=["4:"], completions=[[{"role": "assistant", "content": "44"}]], completion_ids=[[8, 8]], digit=[4]
    )
    assert out == [1.0]


def test_first_digit_reward_is_one_for_a_completion_that_starts_with_the_digit():
    prompts = ["7:", "7:", "7:", "3:", "0:"]
    completions = ["7", "71 9", "17", "", [{"role": "assistant", "content": "0 0"}]]
    assert first_digit_reward(prompts, completions) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert first_digit_reward(["bad prompt"], ["-"]) == [0.0]


def test_the_builtin_task_flag_picks_the_reward(tmp_path):
    from asyncgrpo.inputs import load_reward_funcs

    assert load_reward_funcs(demo_config(tmp_path)) == [repeat_digit_reward]
    assert load_reward_funcs(demo_config(tmp_path, builtin_task="first_digit")) == [first_digit_reward]


@pytest.mark.slow
def test_the_first_digit_task_starts_near_one_in_sixteen_with_most_groups_all_wrong_and_learns(tmp_path):
    """Plain TRL with the demo's defaults: a random tiny policy succeeds on about 9% of its samples (seed 0) and
    half its groups have zero reward variance; 100 steps reach about 0.35 (0.95 by step 400)."""
    from trl import GRPOConfig, GRPOTrainer

    class StopAt(_RewardLogs):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= 100  # with the 1000-step schedule's learning rate

    args = GRPOConfig(**{**DEMO_DEFAULTS, **cpu_overrides(), "output_dir": str(tmp_path / "out"), "seed": 0,
                         "disable_tqdm": True})
    tok, recorder = build_tokenizer(), StopAt()
    GRPOTrainer(model=build_model(seed=0, tokenizer=tok), reward_funcs=first_digit_reward, args=args,
                train_dataset=build_dataset(seed=0), processing_class=tok, callbacks=[recorder]).train()
    first, last = recorder.logs[:10], recorder.logs[-20:]
    assert 0.03 <= sum(e["reward"] for e in first) / 10 <= 0.2
    assert sum(e["frac_reward_zero_std"] for e in first) / 10 >= 0.3
    assert min(e["completions/min_length"] for e in first) < DEMO_DEFAULTS["max_completion_length"]  # EOS ends some
    assert sum(e["reward"] for e in last) / 20 >= 0.25


def test_tokenizer_char_level_round_trip():
    tok = build_tokenizer()
    ids = tok("7:7777")["input_ids"]
    assert len(ids) == 6
    assert tok.convert_ids_to_tokens(ids) == list("7:7777")
    assert tok.decode(ids) == "7:7777"
    assert tok("7:")["input_ids"] == ids[:2]
    assert tok.eos_token is not None and tok.pad_token is not None and tok.bos_token is not None
    assert len({tok.eos_token_id, tok.pad_token_id, tok.bos_token_id, tok.unk_token_id}) == 4
    assert tok.padding_side == "left"
    # A generated completion (eos then padding) decodes to the bare characters.
    completion = tok("777")["input_ids"] + [tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(completion, skip_special_tokens=True) == "777"
    batch = tok(["7:", "7:77"], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2
    assert batch["attention_mask"][0] == [0, 0, 1, 1]


def test_model_deterministic_per_seed():
    a, b, c = build_model(seed=0), build_model(seed=0), build_model(seed=1)
    assert _state_dicts_equal(a, b)
    assert not _state_dicts_equal(a, c)
    tok = build_tokenizer()
    assert a.config.vocab_size == len(tok)
    assert a.config.eos_token_id == tok.eos_token_id and a.config.pad_token_id == tok.pad_token_id
    n_params = sum(p.numel() for p in a.parameters())
    assert 50_000 < n_params < 120_000


def test_build_model_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_write_demo_model_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_demo_model(tmp_path / "demo", seed=3)
    assert (tmp_path / "demo" / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert _state_dicts_equal(model, build_model(seed=3))

    tok, ref = AutoTokenizer.from_pretrained(path), build_tokenizer()
    assert type(tok) is type(ref)
    for text in ("7:7777", "0:", "9: 12", "x7"):
        assert tok(text)["input_ids"] == ref(text)["input_ids"]
    assert tok.decode(tok("3:333")["input_ids"]) == "3:333"
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (ref.eos_token_id, ref.pad_token_id,
                                                                      ref.bos_token_id)
    assert tok.padding_side == "left"
    assert len(tok) == len(ref)


def test_dataset_balanced_and_shuffled():
    ds = build_dataset(n=200, seed=0)
    assert len(ds) == 200
    assert all(re.fullmatch(r"[0-9]:", p) for p in ds["prompt"])
    assert all(p == f"{d}:" for p, d in zip(ds["prompt"], ds["digit"], strict=True))
    assert collections.Counter(ds["digit"]) == {d: 20 for d in range(10)}
    assert ds["prompt"] == build_dataset(n=200, seed=0)["prompt"]
    assert ds["prompt"] != build_dataset(n=200, seed=1)["prompt"]
    assert ds["prompt"][:10] != [f"{d}:" for d in range(10)]
    counts = collections.Counter(build_dataset(n=25, seed=0)["digit"])
    assert max(counts.values()) - min(counts.values()) <= 1


def test_demo_defaults_are_grpo_config_fields_that_a_run_without_a_task_gets(tmp_path):
    """The demo's table is GRPOConfig keyword arguments (TRL's names and meanings); a config parsed without a
    model, dataset or reward function holds every value of it (as GRPOConfig reads it), its checkpoints
    excepted (the command-line demo saves them, so that a relaunch resumes), unless the user's own flag says
    otherwise; a reward function of the user's own turns the table off."""
    from trl import GRPOConfig

    from asyncgrpo.config import AsyncGRPOConfig
    from asyncgrpo.config_parser import parse_config

    unknown = (set(DEMO_DEFAULTS) | set(cpu_overrides())) - {f.name for f in dataclasses.fields(GRPOConfig)}
    assert not unknown, f"not GRPOConfig fields: {sorted(unknown)}"
    out = ["--output_dir", str(tmp_path / "out")]
    table = AsyncGRPOConfig(**DEMO_DEFAULTS, output_dir=str(tmp_path / "out"))  # the values as TRL reads them
    trl_defaults = AsyncGRPOConfig(output_dir=str(tmp_path / "out"))
    demo = parse_config(out)
    for name in DEMO_DEFAULTS:
        if name != "save_strategy":
            assert getattr(demo, name) == getattr(table, name), (name, getattr(demo, name))
    assert demo.save_strategy == "steps" and demo.save_steps > 0
    assert [name for name in DEMO_DEFAULTS if getattr(table, name) != getattr(trl_defaults, name)], (
        "the demo's table changes nothing")
    mine = parse_config([*out, "--learning_rate", "5e-4"])  # the user's flag wins, the rest is the demo's
    assert mine.learning_rate == 5e-4 and mine.max_steps == table.max_steps
    assert mine.max_completion_length == table.max_completion_length
    own_task = parse_config([*out, "--reward_funcs", "mypkg.rewards:score"])
    for name in DEMO_DEFAULTS:
        assert getattr(own_task, name) == getattr(trl_defaults, name), name


@pytest.mark.filterwarnings("ignore")
def test_grpo_trainer_runs_on_cpu(tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(**{**DEMO_DEFAULTS, **cpu_overrides(), "output_dir": str(tmp_path / "out"), "max_steps": 2,
                         "seed": 0, "disable_tqdm": True})
    tok = build_tokenizer()
    recorder = _RewardLogs()
    trainer = GRPOTrainer(
        model=build_model(seed=0, tokenizer=tok),
        reward_funcs=repeat_digit_reward,
        args=args,
        train_dataset=build_dataset(n=40, seed=0),
        processing_class=tok,
        callbacks=[recorder],
    )
    assert trainer.args.bf16 is False
    assert trainer.model.device.type == "cpu"
    trainer.train()
    logs = recorder.logs
    assert len(logs) == 2
    assert all(0.0 <= entry["reward"] <= 1.0 for entry in logs)
    assert all(entry["completions/max_length"] <= DEMO_DEFAULTS["max_completion_length"] for entry in logs)


@pytest.mark.filterwarnings("ignore")
def test_each_job_samples_with_its_own_seed(tmp_path):
    """Workers' trainers are all seeded alike at start-up; a job's seed comes from its id, so two
    workers never sample in lockstep and a job samples the same whichever worker runs it."""
    from asyncgrpo.events import EventLog
    from worker.generate import build_trainer, generate_and_score, job_seed

    cfg = demo_config(tmp_path)
    tok = build_tokenizer()
    dataset = build_dataset(n=40, seed=0)
    trainer = build_trainer(cfg, build_model(seed=0, tokenizer=tok), tok, [repeat_digit_reward], dataset)
    rows = [dataset[i // cfg.num_generations] for i in range(cfg.generation_batch_size)]

    def completions(job_id):
        batch, _ = generate_and_score(trainer, rows, EventLog.off(), seed=job_seed(cfg.seed, job_id), job_id=job_id)
        return batch["completion_ids"]

    first, again, other = completions("000000_000"), completions("000000_000"), completions("000000_001")
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert job_seed(0, "000000_000") != job_seed(1, "000000_000")
