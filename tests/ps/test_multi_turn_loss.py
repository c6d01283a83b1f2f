"""The PS trains a multi-turn batch as TRL trains it: tool-result tokens (``tool_mask`` 0) out of the loss
and out of the off-policy weights.

A worker runs TRL's own tool loop with a model that makes real calls (tests/processes/tool_rollouts.py); the PS
takes its result as it takes any; TRL's loss on the same batch (the worker's trainer, a plain
GRPOTrainer) is the reference.
"""

from __future__ import annotations

import pytest
import torch
from helpers import demo_config
from processes.tool_rollouts import write_tool_model
from trl import GRPOTrainer

from asyncgrpo.events import EventLog
from asyncgrpo.inputs import load_model_and_tokenizer
from asyncgrpo.jobqueue.handoff import REWARDS_KEY
from asyncgrpo.run import RunDir
from asyncgrpo.tasks.lookup import LookupEnv, build_dataset
from asyncgrpo.user_code import RolloutHooks
from ps.trainer import AsyncGRPOTrainer
from worker.generate import build_trainer, generate_and_score

pytestmark = pytest.mark.filterwarnings("ignore")
FIELDS = {"per_device_train_batch_size": 16, "num_generations": 4, "max_completion_length": 16,
          "max_tool_calling_iterations": 2}


def answered_secret(completions, secret, **kwargs) -> list[float]:
    return [float(bool(c) and c[-1].get("content") == str(s)) for c, s in zip(completions, secret, strict=True)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(PS trainer, worker trainer, one multi-turn result's batch), both trainers on the same weights."""
    root = tmp_path_factory.mktemp("multi_turn")
    path = write_tool_model(root / "model")
    run = RunDir.create(root / "run")
    hooks = RolloutHooks(environment_factory=LookupEnv)
    dataset = build_dataset(n=40)
    cfg = demo_config(root, "--run_dir", str(run.root), **FIELDS)
    ps = AsyncGRPOTrainer(cfg, run, *load_model_and_tokenizer(path), [answered_secret], dataset, hooks=hooks)
    ps.model.train()
    ps.current_gradient_accumulation_steps = 1
    worker = build_trainer(demo_config(root / "w", **FIELDS), *load_model_and_tokenizer(path), [answered_secret],
                           dataset, hooks=hooks)
    rows = [dataset[i // 4] for i in range(16)]
    batch, _ = generate_and_score(worker, rows, EventLog.off(), seed=0)
    batch.pop(REWARDS_KEY)
    # The taught model answers most rows right (advantages near 0): advantages of both signs exercise the loss.
    batch["advantages"] = torch.randn(batch["advantages"].shape, generator=torch.Generator().manual_seed(0))
    assert (batch["tool_mask"] == 0).any(dim=1).sum() >= 4, "rows with tool results"
    yield ps, worker, batch
    ps.publisher.close()
    ps.events.close()


def ps_loss_grads(ps, batch):
    """The PS's loss on a result's batch, as its trainer feeds it to TRL (ps/trainer.py)."""
    inputs = dict(batch)
    inputs[ps.weighting.input_key] = inputs.pop("old_per_token_logps")
    inputs["num_items_in_batch"] = (inputs["completion_mask"] * inputs["tool_mask"]).sum()
    ps.model.zero_grad()
    loss = ps._compute_loss(ps.model, inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in ps.model.parameters()]


def trl_loss_grads(worker, batch):
    """TRL's own loss on the batch (the behaviour log-probs as its old_per_token_logps)."""
    inputs = {**batch, "num_items_in_batch": (batch["completion_mask"] * batch["tool_mask"]).sum()}
    worker.model.zero_grad()
    worker.current_gradient_accumulation_steps = 1
    loss = GRPOTrainer._compute_loss(worker, worker.model, inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in worker.model.parameters()]


GRAD_RTOL = 1e-4  # of each gradient's norm (see assert_same)


def assert_same(a, b):
    """The same loss, and each parameter's gradient the same to GRAD_RTOL of its norm. Two model instances sum in
    float32 in an order that depends on the CPU and its BLAS kernels: measured, their gradients differ by up to
    ~1e-5 of a tensor's norm, elementwise by up to ~2e-6 (so no fixed absolute tolerance holds everywhere);
    dropping the tool mask from the loss moves every tensor by 1e-2 to 8e-2 of its norm."""
    loss_a, grads_a = a
    loss_b, grads_b = b
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in grads_b)
    for i, (ga, gb) in enumerate(zip(grads_a, grads_b, strict=True)):
        off = float((ga - gb).norm())
        assert off <= GRAD_RTOL * float(gb.norm()) + 1e-12, f"gradient {i}: |a - b| = {off:.3g}, |b| = {gb.norm():.3g}"


def test_the_ps_loss_and_gradients_on_a_multi_turn_batch_are_trls(setup):
    ps, worker, batch = setup
    assert_same(ps_loss_grads(ps, batch), trl_loss_grads(worker, batch))


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
def test_tool_result_tokens_weigh_nothing_in_the_ps_loss(setup, mode):
    """Garbage behaviour log-probs on the tool-result tokens change nothing, whether the off-policy weight is per
    token or one per sequence (a product over its model tokens); a shift on model tokens does."""
    ps, _, batch = setup
    saved, ps.weighting.mode = ps.weighting.mode, mode
    try:
        check_tool_tokens_weigh_nothing(ps, batch)
    finally:
        ps.weighting.mode = saved


def check_tool_tokens_weigh_nothing(ps, batch):
    tool_tokens = (batch["tool_mask"] == 0) & batch["completion_mask"].bool()
    g = torch.Generator().manual_seed(0)
    noisy = dict(batch)
    noisy["old_per_token_logps"] = torch.where(tool_tokens, -5 * torch.rand(tool_tokens.shape, generator=g),
                                               batch["old_per_token_logps"])
    assert_same(ps_loss_grads(ps, noisy), ps_loss_grads(ps, batch))
    model_tokens = (batch["tool_mask"] == 1) & batch["completion_mask"].bool()
    shifted = dict(batch)
    shifted["old_per_token_logps"] = torch.where(model_tokens, batch["old_per_token_logps"] - 1.0,
                                                 batch["old_per_token_logps"])
    moved = [(a - b).abs().max() for a, b in zip(ps_loss_grads(ps, shifted)[1], ps_loss_grads(ps, batch)[1],
                                                  strict=True)]
    assert max(moved) > 1e-3
