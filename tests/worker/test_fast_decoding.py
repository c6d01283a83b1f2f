"""Fast generation on a worker: several jobs in one generate call, and compiled decoding.

Compiling takes seconds to tens of seconds on this CPU: one compiled trainer is shared by the
tests of this module, and each test leaves its weights as it found them or syncs new ones in.
"""

from __future__ import annotations

from contextlib import closing

import pytest
import torch
from helpers import demo_config
from helpers.decoding import (
    VARIED_PROMPTS,
    Events,
    assert_captured_within_bf16_of_trls,
    counted,
    job,
    trl_logps,
    two_jobs,
)

from asyncgrpo.events import EventLog
from asyncgrpo.run import RunDir
from asyncgrpo.tasks.demo import build_dataset, build_model, build_tokenizer, repeat_digit_reward
from asyncgrpo.weights import make_publisher, make_subscriber
from worker.decoding.compiled import CompiledDecodeStep, CompiledDecoding, generating_model
from worker.generate import build_trainer, generate_jobs
from worker.in_flight import CHECK_EVERY, InFlightWeights
from worker.trl_seam import BEHAVIOUR_LOGPS

pytestmark = pytest.mark.filterwarnings("ignore")

# Prompts of 2 to 9 tokens (one token per character): the shared call left-pads them to the longest.
SAMPLING = {"top_k": 5, "top_p": 0.9}


def make_trainer(tmp_path, reward=repeat_digit_reward, **overrides):
    cfg = demo_config(tmp_path, **{**SAMPLING, **overrides})
    tok = build_tokenizer()
    return build_trainer(cfg, build_model(seed=0, tokenizer=tok), tok, [reward], build_dataset(n=40))


def greedy(trainer, prompt_ids, decoding=None) -> list[list[int]]:
    """The trainer's greedy completions of ``prompt_ids`` (with compiled decoding: in its fixed batch)."""
    trainer.generation_config.do_sample = False
    try:
        with torch.no_grad():
            batch = decoding.pad_batch(prompt_ids) if decoding is not None else prompt_ids
            completion_ids, _ = trainer._generate_single_turn(batch, None, {}, 8)
    finally:
        trainer.generation_config.do_sample = True
    return completion_ids[: len(prompt_ids)]


def eager_greedy(tmp_path, state_dict, prompt_ids) -> list[list[int]]:
    """Greedy completions of an eager trainer whose model holds ``state_dict``."""
    eager = make_trainer(tmp_path)
    eager.model.load_state_dict(state_dict)
    return greedy(eager, prompt_ids)


def assert_captured_equal_trls(trainer, outcomes):
    for outcome in outcomes:
        assert not isinstance(outcome, Exception), outcome
        batch = outcome.batch
        diff = (batch["old_per_token_logps"] - trl_logps(trainer, batch)).abs() * batch["completion_mask"]
        assert diff.max().item() < 1e-4


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A trainer with compiled decoding for two jobs per call, warmed up."""
    trainer = make_trainer(tmp_path_factory.mktemp("compiled"))
    dataset = trainer.train_dataset
    prompt_ids, _, _ = trainer._tokenize_prompts([dataset[i]["prompt"] for i in range(len(dataset))])
    decoding = CompiledDecoding(trainer, 2, prompt_ids)
    decoding.warm_up(prompt_ids)
    return trainer, decoding


# ---------------------------------------------------------------- several jobs per generate call

def test_two_jobs_share_one_generate_call_and_each_gets_its_own_result(tmp_path):
    trainer = make_trainer(tmp_path)
    model = generating_model(trainer.accelerator.unwrap_model(trainer.model_wrapped))
    generate_calls = counted(trainer, model, "generate")
    forward_passes = counted(trainer, trainer, BEHAVIOUR_LOGPS)
    events = Events()
    jobs = two_jobs(trainer)
    outcomes = generate_jobs(trainer, jobs, events, with_logs=True)
    assert len(generate_calls) == 1 and forward_passes == []  # one call; log-probs captured, not recomputed
    assert_captured_equal_trls(trainer, outcomes)
    for j, outcome in zip(jobs, outcomes, strict=True):
        assert outcome.batch["completion_ids"].size(0) == len(j.rows)
        assert outcome.logs["prompt"] == [row["prompt"] for row in j.rows]  # its own completions table
        assert "reward" in outcome.metrics
    # Each job's reward is its own: the first job's prompts are not the second's.
    ends = [fields["job_id"] for event, fields in events.emitted if event == "generate_end"]
    assert ends == ["000000_000", "000000_001"]


def test_a_reward_that_raises_on_one_job_fails_that_job_alone(tmp_path):
    def reward(prompts, completions, **kwargs):
        if any(p.startswith("45") for p in prompts):
            raise ValueError("no reward for 45")
        return repeat_digit_reward(prompts, completions, **kwargs)

    trainer = make_trainer(tmp_path, reward=reward)
    first, second = generate_jobs(trainer, two_jobs(trainer), Events())
    assert not isinstance(first, Exception)
    assert isinstance(second, ValueError) and "no reward for 45" in str(second)


def test_a_job_with_an_empty_prompt_fails_alone_and_says_so(tmp_path):
    """TRL padded a job of empty prompts into a float tensor: the job was trained, and the PS's loss failed on it."""
    trainer = make_trainer(tmp_path)
    first, second = generate_jobs(trainer, [two_jobs(trainer)[0], job(1, ["", "3:"], trainer)], Events())
    assert not isinstance(first, Exception)
    assert isinstance(second, ValueError) and "row 0's prompt '' has no token: nothing to generate from" in str(second)


def test_a_shared_call_that_raises_is_done_job_by_job(tmp_path, caplog):
    trainer = make_trainer(tmp_path)
    model = generating_model(trainer.accelerator.unwrap_model(trainer.model_wrapped))
    original = model.generate
    sizes = []

    def generate(*args, **kwargs):
        sizes.append(kwargs["input_ids"].size(0))
        if kwargs["input_ids"].size(0) > 32:
            raise RuntimeError("out of memory for 64 rows")
        return original(*args, **kwargs)

    model.generate = generate
    outcomes = generate_jobs(trainer, two_jobs(trainer), Events())
    assert sizes == [64, 32, 32]
    assert_captured_equal_trls(trainer, outcomes)
    assert "generating 2 jobs in one call raised RuntimeError: out of memory for 64 rows" in caplog.text


# ---------------------------------------------------------------- compiled decoding

@pytest.mark.process
def test_compiled_decoding_compiles_before_the_first_job_and_not_after(compiled):
    trainer, decoding = compiled
    assert decoding.graphs_after_warm_up >= 1
    step = generating_model(trainer.accelerator.unwrap_model(trainer.model_wrapped))._compiled_call
    assert isinstance(step, CompiledDecodeStep)
    original, calls = step.compiled, []

    def compiled_step(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    step.compiled = compiled_step
    try:  # one job (filled up to the fixed batch), two jobs, other prompt lengths: no new graph
        generate_jobs(trainer, [job(0, VARIED_PROMPTS, trainer)], Events(), decoding)
        generate_jobs(trainer, two_jobs(trainer), Events(), decoding)
    finally:
        step.compiled = original
    assert len(calls) >= 2 * (trainer.max_completion_length - 1)  # generate decoded through the compiled step
    assert decoding.recompiles() == 0


@pytest.mark.process
def test_compiled_decoding_takes_weights_published_during_a_job_between_its_steps(compiled, tmp_path):
    """In-flight updates (tests/worker/test_in_flight.py for eager and graph decoding): generate's stopping criterion
    syncs them between the compiled steps; tokens from the sync on are sampled, and scored, by the new weights."""
    trainer, decoding = compiled
    model = trainer.model
    ps_model = build_model(seed=0, tokenizer=build_tokenizer())
    ps_model.load_state_dict(model.state_dict())
    run = RunDir.create(tmp_path / "run")
    with closing(make_publisher(run, ps_model, "mmap")) as publisher, closing(make_subscriber(run)) as subscriber:
        publisher.publish(version=10, step=10)
        assert subscriber.sync(model) == 10
        first_norm = model.model.norm.weight.detach().clone()
        with torch.no_grad():
            ps_model.model.norm.weight.mul_(1.5).add_(0.3)  # acts after every layer: the KV cache is the same
        publisher.publish(version=11, step=11)
        in_flight = InFlightWeights(subscriber, model, EventLog.off())
        in_flight.version = 10
        outcomes = generate_jobs(trainer, two_jobs(trainer), Events(), decoding, in_flight=in_flight)
    assert decoding.recompiles() == 0 and in_flight.version == 11
    for outcome in outcomes:
        assert outcome.token_versions == [[(0, 10), (CHECK_EVERY, 11)]] * trainer.args.generation_batch_size
        batch = outcome.batch
        captured, mask = batch["old_per_token_logps"], batch["completion_mask"].bool()
        assert mask[:, CHECK_EVERY:].any(), "no completion reached the sync"
        under_new = trl_logps(trainer, batch)
        with torch.no_grad():
            model.model.norm.weight.copy_(first_norm)
        under_old = trl_logps(trainer, batch)
        with torch.no_grad():
            model.model.norm.weight.copy_(ps_model.model.norm.weight)
        before, after = mask.clone(), mask.clone()
        before[:, CHECK_EVERY:], after[:, :CHECK_EVERY] = False, False
        torch.testing.assert_close(captured[before], under_old[before], atol=1e-4, rtol=0)
        torch.testing.assert_close(captured[after], under_new[after], atol=1e-4, rtol=0)


@pytest.mark.process
def test_a_compilation_that_fails_leaves_the_worker_decoding_eagerly(tmp_path, monkeypatch, caplog):
    from worker.decoding.build import build_decoder

    trainer = make_trainer(tmp_path, worker_decoding="compiled")
    eager_settings = trainer.generation_config.to_dict()

    def backend_fails(self, prompt_ids):
        raise RuntimeError("inductor: C++ compile error")

    monkeypatch.setattr(CompiledDecoding, "warm_up", backend_fails)
    assert build_decoder(trainer.args, trainer, 1, Events()).mode == "eager"
    assert "dev1 compiled decoding failed to compile (RuntimeError: inductor: C++ compile error); decoding eagerly" in (
        caplog.text)
    assert trainer.generation_config.to_dict() == eager_settings
    assert "_compiled_call" not in generating_model(trainer.model).__dict__
    [outcome] = generate_jobs(trainer, [job(0, VARIED_PROMPTS, trainer)], Events())
    assert_captured_equal_trls(trainer, [outcome])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_decoding_on_the_gpu_with_cuda_graphs_captures_log_probs_within_bf16_tolerance(tmp_path):
    trainer = make_trainer(tmp_path, use_cpu=False, device_type="cuda", bf16=True)
    trainer.model.to("cuda")
    dataset = trainer.train_dataset
    prompt_ids, _, _ = trainer._tokenize_prompts([dataset[i]["prompt"] for i in range(len(dataset))])
    decoding = CompiledDecoding(trainer, 2, prompt_ids)
    decoding.warm_up(prompt_ids)
    assert trainer.generation_config.compile_config.mode == "reduce-overhead"  # CUDA graphs
    outcomes = generate_jobs(trainer, two_jobs(trainer), Events(), decoding)
    assert decoding.recompiles() == 0
    assert_captured_within_bf16_of_trls(trainer, outcomes)


