"""A worker's job is TRL's own generation batch: the same rows, weights and sampling seed through TRL's
``_generate_and_score_completions`` (a plain GRPOTrainer, as TRL trains) and through the worker's
``generate_and_score`` give the same tensors, key by key (prompt and completion ids and masks, the tool mask,
advantages, the loss normaliser), for a single-turn task (the demo) and a multi-turn one (the lookup task's
tool loop, with a model that makes real calls). A change that made the worker depart from TRL (a mask lost, a
setting not passed, a rollout cut otherwise) fails here."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import demo_config
from processes.tool_rollouts import taught_tool_model
from trl import GRPOTrainer

from asyncgrpo.events import EventLog
from asyncgrpo.tasks import demo, lookup
from asyncgrpo.user_code import RolloutHooks
from worker.generate import build_trainer, generate_and_score

pytestmark = pytest.mark.filterwarnings("ignore")


def trl_and_worker(tmp_path, task: str):
    if task == "lookup":
        tok, model = taught_tool_model()
        rewards, dataset, hooks = [lookup.lookup_reward], lookup.build_dataset(n=40), RolloutHooks(
            environment_factory=lookup.LookupEnv)
        cfg = demo_config(tmp_path, "--builtin_task", "lookup", per_device_train_batch_size=16, num_generations=4)
    else:
        tok = demo.build_tokenizer()
        model = demo.build_model(seed=0, tokenizer=tok)
        rewards, dataset, hooks = [demo.repeat_digit_reward], demo.build_dataset(n=40), RolloutHooks()
        cfg = demo_config(tmp_path, per_device_train_batch_size=16, num_generations=4)
    worker = build_trainer(cfg, copy.deepcopy(model), tok, rewards, dataset, hooks=hooks)
    trl = GRPOTrainer(model=copy.deepcopy(model), reward_funcs=rewards, args=copy.copy(worker.args),
                      train_dataset=dataset, processing_class=tok, **hooks.trainer_kwargs())
    trl.model.train()
    return trl, worker, [dataset[i // 4] for i in range(16)]


@pytest.mark.parametrize("task", ["repeat", "lookup"])
def test_a_workers_job_is_trls_generation_batch_for_the_same_rows_and_seed(tmp_path, task):
    trl, worker, rows = trl_and_worker(tmp_path, task)
    for seed in (1, 2):
        torch.manual_seed(seed)
        expected = trl._generate_and_score_completions(copy.deepcopy(rows))
        got, _ = generate_and_score(worker, copy.deepcopy(rows), EventLog.off(), seed=seed)
        assert set(expected) <= set(got)
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[key].cpu(), value.cpu()), key
            else:
                assert got[key] == value, key
        if task == "lookup":
            assert (got["tool_mask"] == 0).any(dim=1).sum() >= 4  # rows with tool results: the loop ran
