"""Reward models, as trl grpo takes them: --reward_model_name_or_path, or a model's folder among --reward_funcs.
Each worker's TRL loads the model and scores with it; a tiny sequence classifier made here stands in."""

import json
import os
import signal

import pytest
import torch
from helpers import demo_config, expect_exit, ledger, metrics, newest_checkpoint, run_flags, start_process
from transformers import LlamaConfig, LlamaForSequenceClassification

from asyncgrpo.config import ConfigError
from asyncgrpo.events import EventLog
from asyncgrpo.inputs import load_reward_funcs
from asyncgrpo.jobqueue.handoff import REWARDS_KEY
from asyncgrpo.tasks.demo import build_dataset, build_model, build_tokenizer
from worker.generate import build_trainer, generate_and_score


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> str:
    """A 2-layer Llama sequence classifier with one label over the demo tokenizer, saved with save_pretrained."""
    folder = tmp_path_factory.mktemp("reward") / "scorer"
    tok = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForSequenceClassification(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def test_a_reward_model_comes_first_as_a_folder_every_process_loads(tmp_path, reward_model, monkeypatch):
    monkeypatch.chdir(os.path.dirname(reward_model))
    cfg = demo_config(tmp_path, reward_model_name_or_path="./scorer", reward_funcs=["accuracy_reward", "scorer"])
    rewards = load_reward_funcs(cfg)
    assert rewards[0] == rewards[2] == reward_model and callable(rewards[1])  # absolute: workers start elsewhere
    # Alone, it replaces the built-in task's reward.
    assert load_reward_funcs(demo_config(tmp_path, reward_model_name_or_path=reward_model)) == [reward_model]


@pytest.mark.parametrize("flags, message", [
    ({"reward_model_name_or_path": "./missing"}, "--reward_model_name_or_path ./missing: no such folder"),
    ({"reward_funcs": ["{empty}"]}, "no config.json in"),
    ({"reward_model_name_or_path": "{model}", "reward_weights": [1.0, 1.0]}, "2 values for 1 rewards"),
])
def test_a_reward_model_that_cannot_load_is_refused_in_one_line(tmp_path, reward_model, flags, message):
    (tmp_path / "empty").mkdir()
    def fill(value):
        return value.format(empty=tmp_path / "empty", model=reward_model) if isinstance(value, str) else value

    flags = {k: [fill(x) for x in v] if isinstance(v, list) else fill(v) for k, v in flags.items()}
    with pytest.raises(ConfigError, match=message) as refused:
        load_reward_funcs(demo_config(tmp_path, **flags))
    assert "\n" not in str(refused.value)


def test_a_worker_scores_its_completions_with_the_reward_model(tmp_path, reward_model):
    """The rewards a result carries are the classifier's score of each prompt + completion, as TRL computes it."""
    cfg = demo_config(tmp_path, reward_model_name_or_path=reward_model)
    tok = build_tokenizer()
    dataset = build_dataset(n=8)
    trainer = build_trainer(cfg, build_model(seed=0, tokenizer=tok), tok, load_reward_funcs(cfg), dataset)
    rows = [dataset[i // cfg.num_generations] for i in range(cfg.generation_batch_size)]
    batch, _ = generate_and_score(trainer, rows, EventLog.off(), seed=0)
    scorer = LlamaForSequenceClassification.from_pretrained(reward_model).eval()
    texts = [row["prompt"] + tok.decode(ids[mask.bool()], skip_special_tokens=True)
             for row, ids, mask in zip(rows, batch["completion_ids"], batch["completion_mask"], strict=True)]
    with torch.no_grad():
        expected = torch.stack([scorer(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0]
                                for t in texts])
    torch.testing.assert_close(batch[REWARDS_KEY], expected, atol=1e-4, rtol=1e-4)
    assert batch[REWARDS_KEY].std() > 0  # a score, not a constant


@pytest.mark.process
def test_a_ps_and_a_worker_train_on_the_reward_models_scores(tmp_path, reward_model):
    run_root = tmp_path / "run"
    flags = ["--reward_model_name_or_path", reward_model, *run_flags(3, save_steps=3)]
    ps = start_process(run_root, tmp_path / "ps.log", "ps", *flags)
    worker = start_process(run_root, tmp_path / "w1.log", "worker", "--device", "1", *flags)
    try:
        expect_exit(ps, 0, tmp_path / "ps.log", 300)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=120)
    assert [m["step"] for m in metrics(run_root)] == [1, 2, 3] and len(ledger(run_root)) == 3
    # TRL names a reward model by its folder: the workers' metrics of each step are the classifier's.
    history = json.loads((newest_checkpoint(run_root) / "trainer_state.json").read_text())["log_history"]
    steps = [entry for entry in history if "rewards/scorer/mean" in entry]
    assert [entry["step"] for entry in steps] == [1, 2, 3]
    assert all(entry["reward"] == pytest.approx(entry["rewards/scorer/mean"]) for entry in steps)
