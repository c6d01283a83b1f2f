"""Every decoder of worker/decoding (eager, compiled, graph, continuous) through its one interface,
``generate(prompt_ids, seed, in_flight) -> Generation``: each job's greedy tokens are those transformers'
``generate`` gives it alone, behaviour log-probs are TRL's recomputation, a prompt longer than the cache was sized
for decodes correctly, a weight sync reaches the next call in place, and nothing compiles after the warm-up.

Each decoder is built as the worker builds it (compiled, warmed up) once for the module. What only the worker's own
step has (its sampling, the engine's slots) is tested beside its code: test_decode_step.py, test_continuous.py.
"""

from __future__ import annotations

from contextlib import closing

import pytest
import torch
from helpers.decoding import (
    GREEDY,
    JOB_PROMPTS,
    SAMPLING,
    Events,
    counted,
    generated,
    job,
    job_ids,
    llama,
    prompt_ids,
    trainer_for,
    trl_logps,
)

from asyncgrpo.config import WORKER_DECODING_MODES
from asyncgrpo.run import RunDir
from asyncgrpo.weights import make_publisher, make_subscriber
from worker.decoding.compiled import CompiledDecoding
from worker.decoding.continuous import ContinuousDecoding
from worker.decoding.eager import EagerDecoding
from worker.decoding.graph import GraphDecoding
from worker.generate import generate_jobs
from worker.trl_seam import BEHAVIOUR_LOGPS

pytestmark = pytest.mark.filterwarnings("ignore")

MODES = [mode for mode in WORKER_DECODING_MODES if mode != "auto"]  # --worker_decoding's decoders
# The fixtures build each decoder once per module: all but eager compile (so they are left out of the fast tier).
BUILT = [mode if mode == "eager" else pytest.param(mode, marks=pytest.mark.process) for mode in MODES]
JOBS_A_CALL = 2  # the fixed-batch decoders' batch, and the engine's slots, in jobs


def build(mode: str, trainer, ids: list[list[int]], compile: bool = True):
    """``mode``'s decoder, as worker/decoding/build.py makes it (``compile=False``: the own step run eagerly)."""
    if mode == "eager":
        return EagerDecoding(trainer)
    if mode == "compiled":
        return CompiledDecoding(trainer, JOBS_A_CALL, ids)
    if mode == "graph":
        return GraphDecoding(trainer, JOBS_A_CALL, ids, compile=compile)
    return ContinuousDecoding(trainer, JOBS_A_CALL * trainer.args.generation_batch_size, ids, compile=compile)


def generate(decoder, trainer, ids: list[list[int]], seed: int = 0):
    with torch.no_grad(), trainer.accelerator.autocast():
        return decoder.generate(ids, seed)


def alone(reference, jobs: list[list[list[int]]]) -> list[list[int]]:
    """What transformers' generate gives each job's rows, the job alone in its call."""
    return [row for ids in jobs for row in generated(reference, ids)]


@pytest.fixture(scope="module", params=BUILT)
def greedy(request, tmp_path_factory):
    """(mode, trainer, its decoder warmed up, a reference trainer that generates eagerly with the same weights): greedy
    decoding, rows that end early and rows that never end. (The reference keeps the tests' own generate calls from
    compiling graphs on the decoder's model.)"""
    tmp_path = tmp_path_factory.mktemp(request.param)
    trainer = trainer_for(tmp_path, llama(), **GREEDY)
    ids = job_ids(trainer, 0)
    decoder = build(request.param, trainer, ids)
    decoder.warm_up(ids)
    return request.param, trainer, decoder, trainer_for(tmp_path / "reference", llama(), **GREEDY)


def test_each_decoder_is_a_worker_decoding_choice():
    # The choices are listed once (asyncgrpo/config.py WORKER_DECODING_MODES); each names its decoder's ``mode``.
    assert [decoder.mode for decoder in (EagerDecoding, CompiledDecoding, GraphDecoding, ContinuousDecoding)] == MODES


def test_each_jobs_greedy_tokens_are_those_generate_gives_it_alone(greedy):
    mode, trainer, decoder, reference = greedy
    recompiles, lengths = decoder.recompiles(), set()
    for jobs in ([job_ids(trainer, 0), job_ids(trainer, 1)], [job_ids(trainer, 3)]):  # two jobs, one: a short call
        generation = generate(decoder, trainer, [row for ids in jobs for row in ids])
        expected = alone(reference, jobs)
        assert generation.completion_ids == expected
        lengths |= {len(c) for c in expected}
        # The tokens the behaviour log-probs belong to are the completion's.
        for row, ids in enumerate(generation.completion_ids):
            assert generation.behaviour.tokens[row, :len(ids)].tolist() == ids
    assert decoder.recompiles() == recompiles, "a decoding step compiled after the warm-up"
    assert min(lengths) < max(lengths) == trainer.max_completion_length  # an EOS in the middle, and rows at the cap


@pytest.mark.parametrize("greedy", [pytest.param("continuous", marks=pytest.mark.process)], indirect=True)
def test_the_engines_steps_are_two_graphs_whatever_columns_and_rows_they_compute(greedy):
    """On a CPU (eager prefills): one graph for the ranges of slots reading their own columns, one for every step
    whose slots all read the same columns, whatever their number (each bucket) and rows (each narrower width)."""
    _, _, decoder, _ = greedy
    steps = decoder.reads.steps
    assert len({plan for _, plan in steps if not isinstance(plan, tuple)}) > 1  # buckets of columns,
    assert len({width for width, _ in steps}) > 1 and any(isinstance(plan, tuple) for _, plan in steps)  # widths
    assert decoder.warm_up_graphs == 2


@pytest.mark.parametrize("mode", ["eager", "graph", "continuous"])
def test_a_repetition_penalty_and_min_new_tokens_are_applied_as_generate_applies_them(tmp_path, mode):
    # (The own step run eagerly: the math is that of its compiled function. Compiled generate is transformers'.)
    settings = {"repetition_penalty": 1.3, "generation_kwargs": {"do_sample": False, "min_new_tokens": 5}}
    trainer = trainer_for(tmp_path, llama(eos_bias=2.0), **{**GREEDY, **settings})
    jobs = [job_ids(trainer, 0), job_ids(trainer, 1)]
    decoder = build(mode, trainer, jobs[0], compile=False)
    generation = generate(decoder, trainer, jobs[0] + jobs[1])
    assert generation.completion_ids == alone(trainer, jobs)
    assert min(len(c) for c in generation.completion_ids) >= 5


def test_a_weight_sync_reaches_the_next_call_in_place(greedy, tmp_path):
    mode, trainer, decoder, _ = greedy
    model = trainer.model
    original = {name: t.clone() for name, t in model.state_dict().items()}
    ids = job_ids(trainer, 1)
    before = generate(decoder, trainer, ids).completion_ids
    new_weights = llama(seed=1)  # what the PS trained
    run = RunDir.create(tmp_path / "run")
    addresses = [p.data_ptr() for p in model.parameters()]
    recompiles = decoder.recompiles()
    with closing(make_publisher(run, new_weights, "mmap")) as publisher, closing(make_subscriber(run)) as sub:
        publisher.publish(version=1, step=1)
        assert sub.sync(model) == 1
        try:
            assert [p.data_ptr() for p in model.parameters()] == addresses  # in place: a graph stays valid
            after = generate(decoder, trainer, ids).completion_ids
            assert after == generated(trainer_for(tmp_path / "fresh", llama(seed=1), **GREEDY), ids)
            assert after != before  # a graph holding the old weights would decode `before` again
            assert decoder.recompiles() == recompiles
        finally:
            model.load_state_dict(original)
    assert generate(decoder, trainer, ids).completion_ids == before


def test_a_prompt_longer_than_the_cache_was_sized_for_decodes_correctly(greedy):
    mode, trainer, decoder, reference = greedy
    long_prompt = " ".join("0123456789" * 2) + ":"  # 40 tokens; the caches' prompt parts were sized for 16
    ids = prompt_ids(trainer, [long_prompt, "7:", "3 3:", "8:"] * trainer.num_generations)
    assert generate(decoder, trainer, ids).completion_ids == generated(reference, ids)


@pytest.fixture(scope="module", params=BUILT)
def sampling(request, tmp_path_factory):
    """(mode, trainer, decoder): sampling with top-k and top-p (the own step run eagerly: its compiled function is
    the greedy fixture's)."""
    trainer = trainer_for(tmp_path_factory.mktemp(request.param), llama(eos_bias=1.0), **SAMPLING)
    decoder = build(request.param, trainer, job_ids(trainer, 0), compile=False)
    decoder.warm_up(job_ids(trainer, 0))
    return request.param, trainer, decoder


def test_behaviour_log_probs_equal_trls_recomputation_without_a_second_forward(sampling):
    mode, trainer, decoder = sampling
    forward_passes = counted(trainer, trainer, BEHAVIOUR_LOGPS)
    try:
        outcomes = generate_jobs(trainer, [job(i, JOB_PROMPTS[i], trainer) for i in range(2)], Events(), decoder)
        outcomes += generate_jobs(trainer, [job(2, JOB_PROMPTS[2], trainer)], Events(), decoder)  # a short call
    finally:
        delattr(trainer, BEHAVIOUR_LOGPS)
    assert forward_passes == []  # the log-probs came with the tokens
    lengths = set()
    for outcome in outcomes:
        assert not isinstance(outcome, Exception), outcome
        batch = outcome.batch
        mask = batch["completion_mask"]
        diff = (batch["old_per_token_logps"] - trl_logps(trainer, batch)).abs() * mask
        assert diff.max().item() < 1e-4
        lengths |= set(mask.sum(dim=1).tolist())
    assert min(lengths) < trainer.max_completion_length == max(lengths)  # EOS in the middle, and rows never ending


def test_a_call_is_sampled_from_its_seed(sampling):
    """The same seed samples the same tokens; another seed others (with the demo's rows, not all the same)."""
    mode, trainer, decoder = sampling
    ids = job_ids(trainer, 1)
    first = generate(decoder, trainer, ids, seed=5).completion_ids
    assert generate(decoder, trainer, ids, seed=5).completion_ids == first
    assert generate(decoder, trainer, ids, seed=6).completion_ids != first
    same_prompt = first[: trainer.num_generations]  # one prompt's generations: different samples
    assert len({tuple(r) for r in same_prompt}) > 1
