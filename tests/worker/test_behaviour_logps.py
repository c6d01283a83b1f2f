"""Behaviour log-probs captured during generation (worker.generate.BehaviourCapture).

They must equal what TRL's forward pass over the completions gives on the same weights
(``_get_per_token_logps_and_entropies``, the worker's fallback and what the PS's loss
compares with), and that forward pass must run only where capture does not apply.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import demo_config

from asyncgrpo.events import EventLog
from asyncgrpo.tasks.demo import build_dataset, build_model, build_tokenizer, repeat_digit_reward
from worker.behaviour import capture_for
from worker.generate import BehaviourCapture, build_trainer, generate_and_score
from worker.trl_seam import BEHAVIOUR_LOGPS, GENERATE_AND_SCORE

pytestmark = pytest.mark.filterwarnings("ignore")

FALLBACK_LINE = "[gen] behaviour log-probs from a second forward pass"
# Prompts of 2 to 9 tokens (the demo tokenizer is one token per character): TRL left-pads them.
VARIED_PROMPTS = ["7:", "12 3:", "9 9 9 9:", "0 1:"]


def make_trainer(tmp_path, **overrides):
    cfg = demo_config(tmp_path, **overrides)
    tok = build_tokenizer()
    return build_trainer(cfg, build_model(seed=0, tokenizer=tok), tok, [repeat_digit_reward], build_dataset(n=40))


def demo_rows(trainer):
    dataset = trainer.train_dataset
    return [dataset[i // trainer.num_generations] for i in range(trainer.args.generation_batch_size)]


def varied_rows(trainer):
    prompts = VARIED_PROMPTS * (trainer.args.generation_batch_size // trainer.num_generations // len(VARIED_PROMPTS))
    return [{"prompt": prompt} for prompt in prompts for _ in range(trainer.num_generations)]


def count_forward_passes(trainer) -> list:
    """Counts calls of TRL's log-prob forward pass on this trainer (an instance attribute over the method)."""
    calls = []
    method = getattr(trainer, BEHAVIOUR_LOGPS)

    def counted(*args, **kwargs):
        calls.append(args[1].shape)  # (model, input_ids, ...)
        return method(*args, **kwargs)

    setattr(trainer, BEHAVIOUR_LOGPS, counted)
    return calls


def trl_logps(trainer, batch) -> torch.Tensor:
    """TRL's own computation of the batch's per-token log-probs, on the trainer's current weights."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = getattr(type(trainer), BEHAVIOUR_LOGPS)(  # the class's: not counted
            trainer, trainer.model, ids, mask, batch["completion_ids"].size(1))
    return logps


def fallback_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "asyncgrpo.worker" and FALLBACK_LINE in r.getMessage()]


@pytest.mark.parametrize("overrides, rows", [
    ({}, demo_rows),  # the demo task's config and prompts
    ({"temperature": 0.7}, varied_rows),
    ({"temperature": 0.9, "repetition_penalty": 1.3, "pad_to_multiple_of": 16}, varied_rows),
    ({"num_iterations": 2}, demo_rows),  # TRL would recompute old log-probs for several steps per batch
    ({"steps_per_generation": 2}, demo_rows),
], ids=["demo", "temperature", "repetition_penalty_padded", "num_iterations", "steps_per_generation"])
def test_captured_logps_equal_trl_forward_pass(tmp_path, caplog, overrides, rows):
    trainer = make_trainer(tmp_path, **overrides)
    calls = count_forward_passes(trainer)
    batch, _ = generate_and_score(trainer, rows(trainer), EventLog.off(), seed=3)
    assert calls == [], "a forward pass ran although the log-probs were captured"
    assert fallback_lines(caplog) == []

    captured, mask = batch["old_per_token_logps"], batch["completion_mask"].bool()
    assert captured.shape == batch["completion_ids"].shape and captured.dtype == torch.float32
    assert (~mask).any() and mask.any(), "the sample should have completions that end before the longest"
    if rows is varied_rows:
        assert len(set(batch["prompt_mask"].sum(dim=1).tolist())) == len(VARIED_PROMPTS)
    expected = trl_logps(trainer, batch)
    assert torch.allclose(captured[mask], expected[mask], atol=1e-4, rtol=0), (captured - expected).abs().max()
    assert torch.isfinite(captured).all()
    assert (captured[~mask] == 0).all()  # as TRL's forward pass gives them


def feed_decoding_steps(capture, seen, prompt_length, step_logits, out=None):
    """What generate's forwards show the hook (the prompt, then each token sampled from ``seen``), then
    generate's output (``seen`` unless given)."""
    for step, logits in enumerate(step_logits):
        input_ids = seen[:, :prompt_length] if step == 0 else seen[:, prompt_length + step - 1:prompt_length + step]
        capture.on_forward(None, (), {"input_ids": input_ids}, SimpleNamespace(logits=logits))
    capture.finish(seen if out is None else out, prompt_length)


def test_each_token_is_scored_by_the_forward_that_sampled_it(tmp_path):
    trainer = make_trainer(tmp_path, temperature=0.5)
    generator = torch.Generator().manual_seed(0)
    rows, vocab, prompt_length, steps = 3, 16, 4, 5
    step_logits = [torch.randn(rows, 1, vocab, generator=generator) for _ in range(steps)]
    out = torch.randint(0, vocab, (rows, prompt_length + steps), generator=generator)

    capture = BehaviourCapture(trainer)
    feed_decoding_steps(capture, out, prompt_length, step_logits)
    assert capture.why_not is None
    expected = torch.stack([torch.log_softmax(logits[:, -1] / 0.5, dim=-1).gather(1, out[:, [prompt_length + i]])[:, 0]
                            for i, logits in enumerate(step_logits)], dim=1)
    assert torch.allclose(capture.logps, expected, atol=1e-6)

    # generate's output holds a token the forwards did not see: not trusted.
    other = out.clone()
    other[1, prompt_length + 1] = (other[1, prompt_length + 1] + 1) % vocab
    capture = BehaviourCapture(trainer)
    feed_decoding_steps(capture, out, prompt_length, step_logits, out=other)
    assert "not the generated ones" in capture.why_not

    # One forward fewer than generated tokens: not trusted.
    capture = BehaviourCapture(trainer)
    feed_decoding_steps(capture, out, prompt_length, step_logits[:-1])
    assert "do not match the generated tokens" in capture.why_not


def test_the_model_is_left_as_it_was(tmp_path):
    trainer = make_trainer(tmp_path)
    generate_and_score(trainer, demo_rows(trainer), EventLog.off(), seed=0)
    assert "generate" not in vars(trainer.model)
    assert not trainer.model._forward_hooks


@pytest.mark.parametrize("overrides, reason", [
    ({"generation_kwargs": {"num_beams": 2}}, "num_beams > 1"),
    # Prefilling one token at a time: more forwards than generated tokens.
    ({"generation_kwargs": {"prefill_chunk_size": 1}}, "do not match the generated tokens"),
], ids=["beams", "chunked_prefill"])
def test_forward_pass_where_capture_does_not_apply(tmp_path, caplog, overrides, reason):
    trainer = make_trainer(tmp_path, **overrides)
    calls = count_forward_passes(trainer)
    for seed in (1, 2):  # two jobs
        batch, _ = generate_and_score(trainer, demo_rows(trainer), EventLog.off(), seed=seed)
        mask = batch["completion_mask"].bool()
        assert torch.equal(batch["old_per_token_logps"][mask], trl_logps(trainer, batch)[mask])
    assert len(calls) == 2
    lines = fallback_lines(caplog)
    assert len(lines) == 1 and reason in lines[0], lines


def test_rows_out_of_order_are_not_trusted(tmp_path, caplog):
    """Were TRL to return its rows in another order than it generated them, capture notices and falls back."""
    trainer = make_trainer(tmp_path)
    method = getattr(trainer, GENERATE_AND_SCORE)

    def reversed_rows(inputs):
        batch = method(inputs)
        return {k: v.flip(0) if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}

    setattr(trainer, GENERATE_AND_SCORE, reversed_rows)
    calls = count_forward_passes(trainer)
    batch, _ = generate_and_score(trainer, demo_rows(trainer), EventLog.off(), seed=0)
    assert len(calls) == 1
    mask = batch["completion_mask"].bool()
    assert torch.equal(batch["old_per_token_logps"][mask], trl_logps(trainer, batch)[mask])
    assert "not the generated rows in order" in fallback_lines(caplog)[0]


@pytest.mark.parametrize("generation_kwargs", [None, {"num_beams": 2}], ids=["captured", "not_capturable"])
def test_synchronous_mode_sends_no_behaviour_log_probs_and_runs_no_forward_pass(tmp_path, caplog, generation_kwargs):
    """The PS trains with the weights the worker generated with: its ratio current/behaviour is TRL's exact 1 without
    them (captured ones differ from its forward pass by rounding, which parts a synchronous run from TRL's)."""
    trainer = make_trainer(tmp_path, max_staleness=0, generation_kwargs=generation_kwargs)
    calls = count_forward_passes(trainer)
    for seed in (1, 2):
        batch, _ = generate_and_score(trainer, demo_rows(trainer), EventLog.off(), seed=seed)
        assert "old_per_token_logps" not in batch
    assert calls == []
    assert fallback_lines(caplog) == []
    assert capture_for(trainer).why_not == "synchronous mode"  # nothing watched while it generates either
