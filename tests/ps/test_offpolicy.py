"""The off-policy correction (ps/offpolicy.py) through the PS trainer's real loss path: weights and
gradients against a hand computation, TRL's cispo equivalence, the masking variants, TRL's
off_policy_mask_threshold against the behaviour log-probs, and ratio 1 at staleness 0."""

import math

import pytest
import torch
from helpers import demo_config
from trl import GRPOTrainer

from asyncgrpo.events import EventLog
from asyncgrpo.inputs import load_model_and_tokenizer, load_reward_funcs, load_train_dataset, write_demo_model_once
from asyncgrpo.run import RunDir
from ps.offpolicy import importance_weights
from ps.trainer import AsyncGRPOTrainer

pytestmark = pytest.mark.filterwarnings("ignore")
B, P, T = 6, 3, 5
SEQ_SEED = 1  # a seed whose sequence-level ratios fall on both sides of the cap


def test_importance_weights_by_hand():
    proximal = torch.tensor([[0.0, -1.0, -2.0], [-1.0, -1.0, -1.0]])
    behaviour = torch.tensor([[-1.0, -1.0, -0.5], [-1.5, -3.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    e = math.exp  # ratios: e^1, e^0, e^-1.5 / e^0.5, e^2, and 1 for the masked-out token

    def weights(mode):
        return importance_weights(proximal, behaviour, mask, mode, 2.0)

    expected = {"token_truncate": [[2.0, 1.0, e(-1.5)], [e(0.5), 2.0, 1.0]],
                "token_mask": [[0.0, 1.0, e(-1.5)], [e(0.5), 0.0, 1.0]],
                "sequence_truncate": [[e(-0.5)], [2.0]],  # log-ratio sums -0.5 and 2.5
                "sequence_mask": [[e(-0.5)], [0.0]]}
    for mode, values in expected.items():
        torch.testing.assert_close(weights(mode), torch.tensor(values), msg=mode)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    root = tmp_path_factory.mktemp("offpolicy") / "run"
    run = RunDir.create(root)
    cfg = demo_config(root, "--run_dir", str(root), "--device_type", "auto")
    model, tokenizer = load_model_and_tokenizer(write_demo_model_once(run.root))
    trainer = AsyncGRPOTrainer(cfg, run, model, tokenizer, load_reward_funcs(cfg), load_train_dataset(cfg))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    yield trainer
    trainer.publisher.close()
    trainer.events.close()


def make_inputs(trainer, behaviour_shift, advantages=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 3:] = 0  # completions of different lengths
    mask[4, 1:] = 0
    inputs = {"prompt_ids": torch.randint(3, vocab, (B, P), generator=g),
              "prompt_mask": torch.ones(B, P, dtype=torch.long),
              "completion_ids": torch.randint(3, vocab, (B, T), generator=g), "completion_mask": mask,
              "advantages": advantages if advantages is not None else torch.randn(B, generator=g),
              "num_items_in_batch": mask.sum()}
    with torch.no_grad():
        current = policy_logps(trainer, inputs)
    inputs["sampling_per_token_logps"] = current + behaviour_shift * torch.randn(B, T, generator=g)
    return inputs


def policy_logps(trainer, inputs):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, T)
    return logps


def loss_grads(trainer, inputs, *, mode="token_truncate", cap=2.0, loss_type="dapo", epsilon_high=0.2,
               mask_threshold=None):
    saved = (trainer.weighting.mode, trainer.weighting.cap, trainer.loss_type, trainer.epsilon_high,
             trainer.off_policy_mask_threshold)
    trainer.weighting.mode, trainer.weighting.cap, trainer.loss_type = mode, cap, loss_type
    trainer.epsilon_high, trainer.off_policy_mask_threshold = epsilon_high, mask_threshold
    try:
        trainer.model.zero_grad()
        trainer._compute_loss(trainer.model, inputs).backward()
        return [p.grad.clone() for p in trainer.model.parameters()]
    finally:
        (trainer.weighting.mode, trainer.weighting.cap, trainer.loss_type, trainer.epsilon_high,
         trainer.off_policy_mask_threshold) = saved


def hand_grads(trainer, inputs, weights):
    """Gradient of the truncated-IS policy gradient loss, dapo-normalised: -sum(A w logp) / tokens."""
    trainer.model.zero_grad()
    logps = policy_logps(trainer, inputs)
    mask = inputs["completion_mask"]
    loss = -(inputs["advantages"].unsqueeze(1) * weights * logps * mask).sum() / mask.sum()
    loss.backward()
    return [p.grad.clone() for p in trainer.model.parameters()]


# Of each gradient's norm (see assert_same). Both sides run the same forward and backward through the model; only
# the loss on its log-probs differs. Measured: they agree to 5e-8 of the norm or better, and one token's weight
# (of 22) 0.1% off moves them by ~5e-5 of it.
GRAD_RTOL = 1e-5


def relative_offsets(grads, expected) -> list[float]:
    """Each parameter's |grad - expected| relative to |expected| (0 where both are 0)."""
    return [float((g - e).norm()) / max(float(e.norm()), 1e-30) for g, e in zip(grads, expected, strict=True)]


def assert_same(grads, expected):
    """Each parameter's gradient the same to GRAD_RTOL of its norm. The two sides compute the loss by different
    code paths (the PS's loss against a hand computation, or another loss type), which sum in float32 in orders
    that depend on the CPU and its BLAS kernels: no fixed elementwise tolerance holds for every element (those
    near 0 differ by rounding of the tensor's scale, not their own)."""
    assert any(g.abs().sum() > 0 for g in expected)
    for i, (g, e) in enumerate(zip(grads, expected, strict=True)):
        off = float((g - e).norm())
        assert off <= GRAD_RTOL * float(e.norm()) + 1e-12, f"gradient {i}: |a - b| = {off:.3g}, |b| = {e.norm():.3g}"


SEEDS = {"token_truncate": 0, "token_mask": 0, "sequence_truncate": SEQ_SEED, "sequence_mask": SEQ_SEED}


def differ(grads, other):
    """Some gradient differs by more than assert_same lets pass."""
    return max(relative_offsets(grads, other)) > GRAD_RTOL


@pytest.mark.parametrize("mode", list(SEEDS))
def test_the_ps_loss_weights_each_token_by_the_capped_ratio_current_over_behaviour(trainer, mode):
    inputs = make_inputs(trainer, behaviour_shift=1.0 if mode.startswith("token") else 0.6, seed=SEEDS[mode])
    with torch.no_grad():
        current = policy_logps(trainer, inputs)
    log_ratio = (current - inputs["sampling_per_token_logps"]) * inputs["completion_mask"]
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(-1, keepdim=True)
    ratio = log_ratio.exp()
    assert (ratio > 2.0).any() and (ratio < 2.0).any()  # the cap binds on some, not all
    weights = ratio.clamp(max=2.0) if mode.endswith("truncate") else torch.where(ratio > 2.0, 0.0, ratio)
    assert_same(loss_grads(trainer, inputs, mode=mode), hand_grads(trainer, inputs, weights))


def test_token_truncate_has_the_gradient_of_trls_cispo_against_the_behaviour_logps(trainer):
    inputs = make_inputs(trainer, behaviour_shift=1.0, seed=1)
    cispo_inputs = {k: v for k, v in inputs.items() if k != "sampling_per_token_logps"}
    cispo_inputs["old_per_token_logps"] = inputs["sampling_per_token_logps"]
    assert_same(loss_grads(trainer, inputs, mode="token_truncate", cap=2.0, loss_type="dapo"),
                loss_grads(trainer, cispo_inputs, mode="none", loss_type="cispo", epsilon_high=2.0))


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "bnpo", "sapo"])
def test_other_loss_types_keep_their_normalisation_and_take_the_weights(trainer, loss_type):
    """At ratio 1 every loss type's gradient is -A grad log pi per token (times its normaliser),
    so a correction with all weights 1 (behaviour = current) equals no correction at all."""
    inputs = make_inputs(trainer, behaviour_shift=0.0, seed=2)
    plain = {k: v for k, v in inputs.items() if k != "sampling_per_token_logps"}
    assert_same(loss_grads(trainer, inputs, loss_type=loss_type), loss_grads(trainer, plain, loss_type=loss_type))
    shifted = make_inputs(trainer, behaviour_shift=1.0, seed=2)
    assert differ(loss_grads(trainer, shifted, loss_type=loss_type), loss_grads(trainer, plain, loss_type=loss_type))


def test_none_gives_trls_clipped_loss_against_the_behaviour_logps(trainer):
    inputs = make_inputs(trainer, behaviour_shift=1.0, seed=3)
    trl_inputs = {k: v for k, v in inputs.items() if k != "sampling_per_token_logps"}
    trl_inputs["old_per_token_logps"] = inputs["sampling_per_token_logps"]
    assert trainer.weighting.input_key == "sampling_per_token_logps"
    trainer.weighting.mode = "none"
    try:
        assert trainer.weighting.input_key == "old_per_token_logps"
    finally:
        trainer.weighting.mode = "token_truncate"
    expected = loss_grads(trainer, trl_inputs, mode="none", loss_type="dapo")
    assert_same(loss_grads(trainer, trl_inputs, mode="token_truncate", loss_type="dapo"), expected)


def test_trls_off_policy_mask_threshold_compares_against_the_behaviour_logps(trainer):
    """Sequence 0 has a negative advantage and its behaviour log-probs are 2 nats above the current
    ones (mean KL 2 > 0.5): TRL's off-policy mask drops it, as if its advantage were 0."""
    advantages = torch.tensor([-1.0, 0.5, -0.3, 0.8, 1.0, -0.2])
    inputs = make_inputs(trainer, behaviour_shift=0.05, advantages=advantages, seed=4)
    inputs["sampling_per_token_logps"][0] += 2.0
    dropped = {**inputs, "advantages": advantages * torch.tensor([0.0, 1, 1, 1, 1, 1])}
    assert_same(loss_grads(trainer, inputs, mask_threshold=0.5), loss_grads(trainer, dropped))
    assert differ(loss_grads(trainer, inputs), loss_grads(trainer, dropped))


def test_at_staleness_0_the_workers_behaviour_logps_are_the_ps_logps(trainer, tmp_path):
    """A worker with the PS's weights: its behaviour log-probs equal the PS's log-probs of the same
    completions, so every importance ratio is 1."""
    from worker.generate import build_trainer, generate_and_score

    model, tokenizer = load_model_and_tokenizer(str(trainer.run.root / "demo_model"))
    model.load_state_dict(trainer.model.state_dict())
    cfg = demo_config(tmp_path / "w", "--device_type", "auto")
    worker = build_trainer(cfg, model, tokenizer, load_reward_funcs(cfg), load_train_dataset(cfg))
    rows = [trainer.train_dataset[i] for i in range(cfg.generation_batch_size // cfg.num_generations)
            for _ in range(cfg.num_generations)]
    batch, _ = generate_and_score(worker, rows, EventLog.off(), seed=0)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        ps_logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, batch["completion_ids"].size(1))
    on = batch["completion_mask"].bool()
    log_ratio = (ps_logps - batch["old_per_token_logps"])[on]
    assert log_ratio.abs().max().item() < 1e-4


def test_a_job_of_several_steps_is_weighted_by_its_proximal_logps_and_clipped_against_them(trainer):
    """A job that trains several optimizer steps brings the log-probs of the weights it was taken
    with (TRL's old_per_token_logps, the proximal policy): each token's weight is
    min(proximal / behaviour, cap), and TRL's PPO ratio current / proximal is clipped at 1 +- epsilon."""
    inputs = make_inputs(trainer, behaviour_shift=1.0, seed=5)
    with torch.no_grad():
        current = policy_logps(trainer, inputs)
    proximal = current + 0.3 * torch.randn(B, T, generator=torch.Generator().manual_seed(6))
    inputs["old_per_token_logps"] = proximal
    mask = inputs["completion_mask"]
    weights = torch.exp((proximal - inputs["sampling_per_token_logps"]) * mask).clamp(max=2.0)
    on = mask.bool()
    assert (weights[on] == 2.0).any() and (weights[on] < 2.0).any()  # the cap binds on some tokens
    assert (((current - proximal).exp() - 1).abs()[on] > 0.2).any()  # and so does PPO's clip

    trainer.model.zero_grad()
    logps = policy_logps(trainer, inputs)
    ratio = torch.exp(logps - proximal)
    advantages = inputs["advantages"].unsqueeze(1)
    per_token = -weights * torch.min(ratio * advantages,
                                     ratio.clamp(1 - trainer.epsilon_low, 1 + 0.2) * advantages)
    ((per_token * mask).sum() / mask.sum()).backward()
    expected = [p.grad.clone() for p in trainer.model.parameters()]

    assert_same(loss_grads(trainer, inputs, loss_type="dapo", epsilon_high=0.2), expected)
    without_proximal = {k: v for k, v in inputs.items() if k != "old_per_token_logps"}
    assert differ(loss_grads(trainer, without_proximal, loss_type="dapo", epsilon_high=0.2), expected)
