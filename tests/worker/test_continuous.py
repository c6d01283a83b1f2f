"""Continuous batching (worker/decoding/continuous.py), what is the engine's own beside what every decoder must do
(tests/worker/test_decoders.py): jobs joining slots other jobs left decode as transformers' generate decodes each
alone (greedy), a job samples what it samples whatever shares its steps, each job records the versions that sampled
its tokens (a row's each, from its own first), and rows that end free their slots for the next waiting row at once.

The engine runs eagerly (``compile=False``: the same functions); compiled, it is one of test_decoders.py's, and
here once with its prefill compiled as on a GPU.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.decoding import (
    DRAWS,
    GREEDY,
    JOB_PROMPTS,
    NO_WARPER,
    SAMPLING,
    SETTINGS,
    SHAPES,
    Events,
    assert_captured_within_bf16_of_trls,
    assert_drawn_from,
    expected_probs,
    generated,
    gpu_trainer,
    job,
    job_ids,
    llama,
    prompt_ids,
    trainer_for,
)
from transformers import LlamaConfig, LlamaForCausalLM

from asyncgrpo.tasks.demo import build_tokenizer
from asyncgrpo.tasks.long_tail import end_with_probability
from worker.decoding.continuous import ContinuousDecoding
from worker.decoding.seeded_draws import seeded_exponentials, unit_interval
from worker.decoding.slot_cache import SlotReads
from worker.decoding.step import Sampling, sample
from worker.generate import score_generated

pytestmark = pytest.mark.filterwarnings("ignore")

def decode_all(engine: ContinuousDecoding, jobs: dict, seeds: dict | None = None) -> dict:
    """Every job of ``jobs`` ({key: prompt ids}) through the engine, in order, each added as the worker's loop claims
    one (a slot free and no row waiting): {key: FinishedJob}."""
    waiting, finished = list(jobs), {}
    with torch.no_grad(), engine.trainer.accelerator.autocast():
        while waiting or not engine.empty():
            while waiting and engine.wants_a_job():
                key = waiting.pop(0)
                engine.add(key, jobs[key], job_seed=(seeds or {}).get(key, 0))
            engine.run(engine.check_every)
            finished.update((f.key, f) for f in engine.collect())
    return finished


# ---------------------------------------------------------------- the tokens: greedy decoding is generate's

@pytest.mark.parametrize("look_every", [1, 8])  # a CPU's, a GPU's
def test_each_job_decodes_the_tokens_generate_gives_it_alone(tmp_path, monkeypatch, look_every):
    """Five jobs through two jobs' slots: each joins when a job leaves, beside a job halfway through, rows moving
    to slots that read more columns as they grow, and, at the end, the few last rows into the first slots of a
    narrower step (the engine as a decoder of one call's jobs, with and without a repetition penalty:
    tests/worker/test_decoders.py). Looking at ended rows every 8 steps, a row that ended goes on being computed
    until the look, its tokens discarded."""
    trainer = trainer_for(tmp_path, llama(), **GREEDY)  # (lengths from 1 to the cap)
    jobs = {i: job_ids(trainer, i) for i in range(5)}
    engine = ContinuousDecoding(trainer, 2 * trainer.args.generation_batch_size, jobs[0], compile=False)
    engine.check_every = look_every
    plans = spy(monkeypatch, engine.reads, "plan")
    finished = decode_all(engine, jobs)
    for i, ids in jobs.items():
        assert finished[i].completion_ids == generated(trainer, ids), f"job {i}"
    lengths = [len(c) for f in finished.values() for c in f.completion_ids]
    assert min(lengths) < max(lengths)  # rows of different lengths: jobs leave and join at different steps
    used = {(width, plan) for _, (width, plan, _) in plans}
    slots = engine.slots
    assert (slots, engine.reads.tiered) in used  # ranges of slots reading their own columns
    assert any(width == slots and plan != engine.reads.tiered for width, plan in used)  # or all alike
    assert {slots} < {width for width, _ in used} <= {slots, *engine.reads.widths}  # the stream's end: narrower
    assert any(moves for _, (width, _, moves) in plans if width == slots)  # rows moved to slots that read more,
    assert any(moves for _, (width, _, moves) in plans if width < slots)  # and into a narrower step's slots


def test_rows_that_start_together_read_only_the_columns_written_so_far(tmp_path, monkeypatch):
    """Fixed lengths, one job's slots: every row is as old as the others, so no row moves, every slot reads the
    same columns, and the second job's steps read what the first job's read, from fewer columns than the cache's up
    to all of them (as the graph decoder's column buckets)."""
    trainer = trainer_for(tmp_path, llama(), max_completion_length=24,
                          generation_kwargs={"do_sample": False, "min_new_tokens": 24})
    engine = ContinuousDecoding(trainer, trainer.args.generation_batch_size, job_ids(trainer, 0), compile=False)
    engine.scheduler.fed_prompt_tokens = 0  # (prefilled: the rows' first tokens come at once)
    calls = spy(monkeypatch, engine.reads, "plan")
    decode_all(engine, {0: job_ids(trainer, 0), 1: job_ids(trainer, 1)})
    assert not any(moves for _, (_, _, moves) in calls)
    assert {width for _, (width, _, _) in calls} == {engine.slots}  # (one job's rows: no step narrower)
    reads = [plan for _, (_, plan, _) in calls]
    half = len(reads) // 2
    assert reads[:half] == reads[half:] and reads == sorted(reads[:half]) * 2
    assert reads[0] < reads[-1] == engine.reads.size


def test_rows_outgrowing_their_slots_columns_move_to_slots_that_read_more():
    """128 slots, prompts of up to 16 tokens, 128 new: half the slots read 48 columns, a quarter 80, and so on. A row
    about to outgrow its slot takes a free slot that holds it, or swaps with a row young enough for its own; where
    that cannot be done, or all rows are young, every slot reads one bucket past the oldest row's."""
    reads = SlotReads(128, 16, 128)
    assert reads.tiered == ((64, 48), (32, 80), (16, 112), (16, 144))
    assert reads.plan({slot: 20 for slot in range(128)}) == (128, 48, [])  # all young: fewer columns than the ranges'

    reach = {slot: 30 for slot in range(128)} | {0: 60, 1: 50, 64: 100, 127: 140}
    del reach[70]  # a free slot reading 80 columns
    width, plan, moves = reads.plan(reach)
    assert (width, plan) == (128, reads.tiered)
    # The oldest first: 64's swaps with a young row of the range of 112 columns, 0's takes the free slot of 80, and
    # 1's swaps with a young row there.
    assert moves == [(64, 96), (96, 64), (0, 70), (1, 65), (65, 1)]
    after = {slot: columns for slot, columns in reach.items() if slot not in dict(moves)}
    after |= {to: reach[origin] for origin, to in moves}
    assert len(after) == len(reach) and all(columns <= reads.columns_of_slot[s] for s, columns in after.items())

    assert reads.plan({slot: 60 for slot in range(128)}) == (128, 80, [])  # all as old: nothing to swap with
    assert reads.plan({slot: 30 for slot in range(128)} | {slot: 120 for slot in range(17)}) == (128, 144, [])


def test_few_rows_move_into_the_first_slots_of_a_narrower_step():
    """With up to three halvings: the fewest of 64, 32 and 16 first slots that hold the rows compute the next steps,
    reading the whole cache, the rows outside them moving into their free slots, the first first."""
    reads = SlotReads(128, 16, 128, narrower=3)
    assert reads.widths == [64, 32, 16]
    assert reads.plan({slot: 30 for slot in range(65)})[:2] == (128, 48)  # (65 rows: every slot)
    assert reads.plan({slot: 30 for slot in range(64)}) == (64, 144, [])  # in place already
    reach = {3: 40, 20: 140, 40: 100, 127: 60}
    assert reads.plan(reach) == (16, 144, [(20, 0), (40, 1), (127, 2)])
    assert reads.plan({}) == (16, 144, [])
    assert SlotReads(16, 16, 128, narrower=3).widths == [8]  # (never fewer than NARROWEST_STEP rows)


def spy(monkeypatch, obj, name: str) -> list:
    """The calls of ``obj.name`` from here on, as (args, result)."""
    calls, method = [], getattr(obj, name)

    def recorded(*args):
        calls.append((args, result := method(*args)))
        return result

    monkeypatch.setattr(obj, name, recorded)
    return calls


def test_each_row_records_the_versions_that_sampled_its_tokens_from_its_own_first(tmp_path):
    """A job's rows join at different steps, as the rows before them end. weights_changed between steps: each
    decoding row's next token starts a run, counted from that row's own first token (sampled by its prefill); a row
    still waiting for a slot starts with the version it joins under."""
    trainer = trainer_for(tmp_path, long_tail_model(1 / 6), temperature=1.0, max_completion_length=24)
    rows = trainer.args.generation_batch_size
    engine = ContinuousDecoding(trainer, rows, job_ids(trainer, 0), compile=False)  # one job's rows of slots
    engine.weights_changed(0)
    version_of_step, finished = {}, {}  # engine step: the version its tokens (and the prefills before it) came from
    with torch.no_grad():
        engine.add("a", job_ids(trainer, 0), job_seed=0)
        engine.add("b", job_ids(trainer, 1), job_seed=1)  # its rows wait for a's to end
        a, b = engine.scheduler.residents
        while not engine.empty():
            if engine.steps % 3 == 2:
                engine.weights_changed(engine.version + 1)
            version_of_step[engine.steps] = engine.version
            engine.run(1)
            finished.update((f.key, f) for f in engine.collect())
    assert len(set(b.joined)) > 3  # b's rows joined at several steps
    for resident in (a, b):
        done = finished[resident.key]
        for row, completion in enumerate(done.completion_ids):
            # Token i >= 1 comes from step joined + i - 1, token 0 from the step before (its prompt fed through the
            # steps) or from the row's prefill, under the version of step joined.
            fed = len(resident.prompt_ids[row]) <= engine.scheduler.fed_prompt_tokens
            versions = [version_of_step[resident.joined[row] + (i - 1 if fed else max(i - 1, 0))]
                        for i in range(len(completion))]
            runs = [(i, v) for i, v in enumerate(versions) if i == 0 or v != versions[i - 1]]
            assert done.token_versions[row] == runs, (resident.key, row)
    assert any(len(runs) > 2 for runs in finished["b"].token_versions)
    fed = engine.scheduler.fed_prompt_tokens
    assert {len(ids) <= fed for ids in b.prompt_ids} == {True, False}  # (fed and prefilled)
    assert finished["b"].weights_version == min(runs[0][1] for runs in finished["b"].token_versions)


# ---------------------------------------------------------------- sampling: per job, whatever shares its steps

def test_a_job_samples_the_same_tokens_alone_and_beside_other_jobs(tmp_path):
    trainer = trainer_for(tmp_path, llama(eos_bias=1.0), **SAMPLING)
    jobs = {i: job_ids(trainer, i) for i in range(4)}
    seeds = {i: 100 + i for i in jobs}
    slots = 2 * trainer.args.generation_batch_size
    together = decode_all(ContinuousDecoding(trainer, slots, jobs[0], compile=False), jobs, seeds)
    for i in (2, 3):  # jobs that joined slots another job had left, beside a job halfway through
        alone = decode_all(ContinuousDecoding(trainer, slots, jobs[0], compile=False), {i: jobs[i]}, seeds)
        assert alone[i].completion_ids == together[i].completion_ids
    rows = together[0].completion_ids
    same_prompt = rows[: trainer.num_generations]  # one prompt's generations: different samples
    assert len({tuple(r) for r in same_prompt}) > 1
    other_seed = decode_all(ContinuousDecoding(trainer, slots, jobs[0], compile=False), {0: jobs[0]}, {0: 999})
    assert other_seed[0].completion_ids != rows


def test_prefills_padded_to_two_sizes_sample_what_exact_ones_do(tmp_path, monkeypatch):
    """Compiled, a prefill takes 8 rows or a job's, the rows joining padded up by repeating the last and their
    prompts to the cache's prompt part (here eager, with the compiled engine's shapes): every job's tokens and
    behaviour log-probs are those of prefills of exactly the joining rows and their longest prompt, and only the two
    shapes ran."""
    trainer = trainer_for(tmp_path, llama(eos_bias=1.0), **SAMPLING)
    jobs = {i: job_ids(trainer, i) for i in range(4)}
    seeds = {i: 100 + i for i in jobs}
    slots = 2 * trainer.args.generation_batch_size
    # (Every row prefilled: with its group's rows copying one prefill, a prefill has at most a job's prompts.)
    eager = ContinuousDecoding(trainer, slots, jobs[0], compile=False, share_prompts=False)
    eager.check_every = 1  # (a look after every step: a few rows join at a time)
    eager.scheduler.fed_prompt_tokens = 0  # (every prompt prefilled)
    eager_prefills, eager_steps = spy(monkeypatch, eager.runner, "_prefill"), spy(monkeypatch, eager.runner,
                                                                                          "_prefill_step")
    exact = decode_all(eager, jobs, seeds)
    # Eager, the rows that join at once go in one prefill of their number, as wide as their longest prompt.
    assert all(len(joining.rows) == joining.size for (joining,), _ in eager_prefills)
    assert any(len(j.rows) & (len(j.rows) - 1) for (j,), _ in eager_prefills)  # (not only powers of two)
    assert any(ids.size(1) < eager.prompt_part for (_, _, ids, *_), _ in eager_steps)
    assert not eager.runner.prefill_caches  # (none kept)
    engine = ContinuousDecoding(trainer, slots, jobs[0], compile=False, share_prompts=False)
    engine.runner.pads_prefills, engine.scheduler.prefill_sizes = True, [8, trainer.args.generation_batch_size]
    engine.check_every, engine.scheduler.fed_prompt_tokens = 1, 0
    prefills = spy(monkeypatch, engine.runner, "_prefill")
    padded = decode_all(engine, jobs, seeds)
    for i in jobs:
        assert padded[i].completion_ids == exact[i].completion_ids, f"job {i}"
        torch.testing.assert_close(padded[i].logps, exact[i].logps)
    joining = [(len(j.rows), j.size) for (j,), _ in prefills]
    assert {size for _, size in joining} == {8, trainer.args.generation_batch_size}
    assert any(n < size for n, size in joining)  # some padded
    assert sorted(engine.runner.prefill_caches) == [(8, engine.prompt_part), (trainer.args.generation_batch_size,
                                                                       engine.prompt_part)]


def test_a_groups_rows_copy_one_prefill_of_its_prompt_and_sample_what_their_own_prefills_give(tmp_path,
                                                                                               monkeypatch):
    """A job's G rows of one prompt: one is prefilled, the others copy its keys and values (those joining with it,
    and those joining later from a slot of the group, their first token from the group's kept logits). Greedy, every
    job decodes generate's tokens; sampled, with and without a repetition penalty, every job samples the tokens and
    gets the behaviour log-probs it gets with every row prefilled; and the prompt tokens computed are a G-th."""
    for settings in (GREEDY, SAMPLING, dict(SAMPLING, repetition_penalty=1.3)):
        trainer = trainer_for(tmp_path, llama(eos_bias=0.0 if settings is GREEDY else 1.0), **settings)
        jobs = {i: job_ids(trainer, i) for i in range(4)}
        seeds = {i: 100 + i for i in jobs}
        slots = trainer.args.generation_batch_size + 4  # (half a group finds slots beside a job: the rest waits)
        engines = {}
        for shares in (True, False):
            engine = engines[shares] = ContinuousDecoding(trainer, slots, jobs[0], compile=False,
                                                          share_prompts=shares)
            # (a few rows join at a time; every prompt prefilled)
            engine.check_every, engine.scheduler.fed_prompt_tokens = 1, 0
        copies = spy(monkeypatch, engines[True].runner, "_copy_prompts")
        shared, own = decode_all(engines[True], jobs, seeds), decode_all(engines[False], jobs, seeds)
        for i, ids in jobs.items():
            assert shared[i].completion_ids == own[i].completion_ids, f"job {i}"
            torch.testing.assert_close(shared[i].logps, own[i].logps)
            if settings is GREEDY:
                assert shared[i].completion_ids == generated(trainer, ids), f"job {i}"
        copied = [(job, row) for (joining,), _ in copies for job, row in joining.rows]
        # Each group's first row prefilled, and the odd row whose group had left the slots when it found one.
        rows, g = len(jobs) * trainer.args.generation_batch_size, trainer.num_generations
        assert rows * (g - 2) / g <= len(copied) <= rows * (g - 1) / g
        # Some rows joined after their group's prefill, from the slot of a row of it that decodes.
        assert any(job.joined[job.group[row]] < job.joined[row] for job, row in copied)
        assert engines[True].prompt_tokens * g / 2 <= engines[False].prompt_tokens


def test_short_prompts_fed_through_the_steps_sample_what_prefilled_ones_do(tmp_path, monkeypatch):
    """Eager (a CPU's), a prompt of up to FED_PROMPT_TOKENS tokens joins without a prefill: its tokens go through
    its slot's next steps, one a step, and its first token is sampled by the step that reads its last. Every job
    samples the tokens, and gets the behaviour log-probs, it gets with every prompt prefilled; with a repetition
    penalty too (the prompt's tokens count as seen, the tokens fed before its end are not sampled)."""
    for settings in (SAMPLING, dict(SAMPLING, repetition_penalty=1.3)):
        trainer = trainer_for(tmp_path, llama(eos_bias=1.0), **settings)
        jobs = {i: job_ids(trainer, i) for i in range(4)}
        seeds = {i: 100 + i for i in jobs}
        slots = 2 * trainer.args.generation_batch_size
        prefilled = ContinuousDecoding(trainer, slots, jobs[0], compile=False)
        prefilled.scheduler.fed_prompt_tokens = 0
        expected = decode_all(prefilled, jobs, seeds)
        engine = ContinuousDecoding(trainer, slots, jobs[0], compile=False)
        with torch.no_grad():
            engine.add("joined", jobs[1], job_seed=0)
        # Its prefilled rows have sampled their first tokens, its fed rows nothing yet.
        assert engine.decoded_tokens() == sum(len(ids) > engine.scheduler.fed_prompt_tokens for ids in jobs[1]) > 0
        engine = ContinuousDecoding(trainer, slots, jobs[0], compile=False)
        prefills = spy(monkeypatch, engine.runner, "_prefill")
        fed = decode_all(engine, jobs, seeds)
        for i in jobs:
            assert fed[i].completion_ids == expected[i].completion_ids, (settings, i)
            torch.testing.assert_close(fed[i].logps, expected[i].logps, atol=1e-5, rtol=1e-4)
        lengths = [len(job.prompt_ids[row]) for (joining,), _ in prefills for job, row in joining.rows]
        assert all(n > engine.scheduler.fed_prompt_tokens for n in lengths)  # only the longer prompts were prefilled
        assert min(len(ids) for job in jobs.values() for ids in job) <= engine.scheduler.fed_prompt_tokens
        assert engine.steps > prefilled.steps  # (the fed prompts' steps)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_seeded_draws_sample_from_the_distribution_transformers_samples_from(setting):
    s = Sampling(**{**NO_WARPER, **SETTINGS[setting]})
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -4.0])
    want = expected_probs(logits, s)
    seeds = torch.arange(DRAWS, dtype=torch.long) * 7919 - 12345  # a row's seed and counter, as the engine's
    noise = seeded_exponentials(seeds, torch.full((DRAWS,), 3), logits.numel())
    tokens = sample(logits.expand(DRAWS, -1).contiguous(), s, noise)
    assert_drawn_from(tokens, want)


def test_no_seeded_draw_is_zero_or_infinite():
    """The hash's extreme words map strictly inside (0, 1): a uniform of 1 would be an Exp(1) draw of 0, which wins
    every race (and beats a token the warpers cut: -inf - log 0 is NaN, which argmax picks)."""
    extremes = torch.tensor([-1, 0, 2**62, -(2**62), 2**63 - 1], dtype=torch.long)  # all ones, all zeros, ...
    u = unit_interval(extremes)
    assert (u > 0).all() and (u < 1).all()
    draws = seeded_exponentials(torch.arange(64), torch.zeros(64, dtype=torch.long), 151_936)
    assert torch.isfinite(draws).all() and (draws > 0).all()


def test_seeded_draws_are_exponential_and_differ_by_seed_counter_and_token():
    draws = seeded_exponentials(torch.tensor([1, 2]), torch.tensor([0, 0]), 50_000)
    assert abs(draws.mean().item() - 1.0) < 0.02 and abs(draws.var().item() - 1.0) < 0.05
    assert torch.equal(draws, seeded_exponentials(torch.tensor([1, 2]), torch.tensor([0, 0]), 50_000))
    assert not torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], seeded_exponentials(torch.tensor([1]), torch.tensor([1]), 50_000)[0])


def test_seeded_draws_are_splitmix64s_top_bits():
    """Each draw is -log((k + 0.5) / 2**23), k the top 23 bits of splitmix64 of seed + (counter * vocab + position)
    * golden, as a reference written with Python's integers computes it (the whole hash: its last step, left out of
    the tensor code, must not change those bits)."""
    import math

    def reference(seed: int, counter: int, position: int, vocab: int) -> float:
        z = (seed + (counter * vocab + position) * 0x9E3779B97F4A7C15) % 2**64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        z ^= z >> 31
        return -math.log(((z >> 41) + 0.5) / 2**23)

    seeds, counters, vocab = [-(2**62) + 7, 0, 123456789, 2**63 - 1], [0, 5, 511, 3], 1000
    draws = seeded_exponentials(torch.tensor(seeds), torch.tensor(counters), vocab)
    for row, (seed, counter) in enumerate(zip(seeds, counters, strict=True)):
        for position in (0, 1, 499, 999):
            assert draws[row, position].item() == pytest.approx(reference(seed, counter, position, vocab), rel=1e-6)


# ---------------------------------------------------------------- behaviour log-probs, and the slots' use

def long_tail_model(p: float = 1 / 16) -> LlamaForCausalLM:
    """A small model whose rows end with probability ``p`` at every token: geometric lengths, mean 1 / p."""
    tok = build_tokenizer()
    config = LlamaConfig(**SHAPES["demo"], num_key_value_heads=4, vocab_size=len(tok), initializer_range=0.02,
                         tie_word_embeddings=False, max_position_embeddings=256, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    end_with_probability(model, tok.eos_token_id, p)
    return model


def test_rows_that_end_free_their_slots_for_the_next_job_at_once(tmp_path):
    """Lengths with a long tail (geometric, mean a quarter of the cap): the engine computes fewer row-steps than a
    fixed batch of the same rows (two jobs a call, decoded until the longer job's longest row ends) on the same
    jobs, and every token it kept is a token of a finished row."""
    trainer = trainer_for(tmp_path, long_tail_model(), temperature=1.0, max_completion_length=64)
    rows = trainer.args.generation_batch_size
    prompts = [p for job_prompts in JOB_PROMPTS for p in job_prompts]
    jobs = {i: prompt_ids(trainer, [p for p in prompts[4 * i % 20:4 * i % 20 + 4] for _ in range(8)])
            for i in range(16)}
    engine = ContinuousDecoding(trainer, 2 * rows, jobs[0], compile=False)
    finished = decode_all(engine, jobs, {i: i for i in jobs})
    lengths = [[len(c) for c in finished[i].completion_ids] for i in sorted(finished)]
    assert 10 < sum(map(sum, lengths)) / (16 * rows) < 22  # the mean length: about 16
    fixed_steps = sum(max(max(a), max(b)) for a, b in zip(lengths[::2], lengths[1::2], strict=True))
    fixed = sum(map(sum, lengths)) / (2 * rows * fixed_steps)
    assert engine.kept_tokens == sum(map(sum, lengths))
    assert engine.utilisation() > 1.5 * fixed  # measured: 0.61 against 0.25
    assert engine.steps < fixed_steps / 1.5


@pytest.mark.process  # (compiles)
def test_with_its_prefill_compiled_as_on_a_gpu_each_job_decodes_as_generate_does_alone(tmp_path):
    """The GPU's way of joining, run on the CPU: every prompt prefilled by a compiled prefill, its joining rows padded
    up to one of two sizes by repeating the last, a group's other rows copying its prompt's columns."""
    trainer = trainer_for(tmp_path, llama(), **GREEDY)
    rows = trainer.args.generation_batch_size
    engine = ContinuousDecoding(trainer, 2 * rows, job_ids(trainer, 0), compile_prefill=True)
    assert engine.runner.prefill_compiled and engine.runner.prefill_sizes == [8, rows]
    engine.warm_up(job_ids(trainer, 0))
    jobs = {i: job_ids(trainer, i) for i in range(4)}  # 4 jobs through 2 jobs' slots: rows join as others end
    finished = decode_all(engine, jobs)
    reference = trainer_for(tmp_path / "reference", llama(), **GREEDY)
    for i, ids in jobs.items():
        assert finished[i].completion_ids == generated(reference, ids), f"job {i}"
    assert engine.recompiles() == 0, "a prefill or step compiled after the warm-up"
    assert engine.prompt_tokens < sum(len(ids) for ids in jobs.values()) * engine.prompt_part  # copies, not prefills


@pytest.mark.process  # (compiles)
def test_no_two_inputs_of_a_compiled_step_or_prefill_share_memory(tmp_path, monkeypatch):
    """Two inputs of a graph that share memory, one of them written (the slots' mask and a view of its first
    columns), become one "synthetic base" in AOTAutograd, which then keeps none of the graph's inputs static: on a GPU
    each CUDA graph replay would copy every parameter and buffer in, or the step would run without a CUDA graph. The
    engine as a GPU compiles it: its prefill too."""
    from torch._functorch._aot_autograd import runtime_wrappers

    merged = []
    merge_view_inputs = runtime_wrappers.merge_view_inputs

    def merge_and_say(*args, **kwargs):
        result = merge_view_inputs(*args, **kwargs)
        merged.append(result[2] is not None)  # (a synthetic base's layout, or None)
        return result

    monkeypatch.setattr(runtime_wrappers, "merge_view_inputs", merge_and_say)
    # AOTAutograd decides on a synthetic base before any backend sees the graph: its own eager backend shows it
    # without inductor's code generation (which took 50 s of this test), and keeps nothing in a cache (a graph taken
    # from one is not merged again).
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    # (one key/value head: shapes of its own, where an engine of the same shapes compiled earlier in the process would
    # lend its graphs, untraced)
    trainer = trainer_for(tmp_path, llama(kv_heads=1), **GREEDY)
    engine = ContinuousDecoding(trainer, 2 * trainer.args.generation_batch_size, job_ids(trainer, 0),
                                compile_prefill=True)
    engine.warm_up(job_ids(trainer, 0))
    # Two prefills (a few rows, a job's), the ranges' step, the same-columns step.
    assert engine.warm_up_graphs == 4 and len(merged) == 4, merged
    assert not any(merged), "a compiled graph takes a synthetic base of aliased inputs"


# ---------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_engine_on_the_gpu_with_cuda_graphs_captures_log_probs_within_bf16_tolerance(tmp_path, monkeypatch):
    """Completions of up to 64 tokens: the steps read by several plans (a graph each), rows moving between slots."""

    trainer = gpu_trainer(tmp_path, max_completion_length=64)
    engine = ContinuousDecoding(trainer, 2 * trainer.args.generation_batch_size, job_ids(trainer, 0))
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    engine.warm_up(job_ids(trainer, 0))
    jobs = [job(i, JOB_PROMPTS[i], trainer) for i in range(4)]
    plans = spy(monkeypatch, engine.reads, "plan")
    finished = decode_all(engine, {i: job_ids(trainer, i) for i in range(4)}, {i: i for i in range(4)})
    assert engine.recompiles() == 0
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips, "a step ran without a CUDA graph"
    assert len({plan for _, (_, plan, _) in plans}) > 1
    outcomes = [score_generated(trainer, j, finished[i].prompt_ids, finished[i].completion_ids, finished[i].tokens,
                                finished[i].logps, Events()) for i, j in enumerate(jobs)]
    assert_captured_within_bf16_of_trls(trainer, outcomes)
    alone = decode_all(engine, {3: job_ids(trainer, 3)}, {3: 3})
    assert alone[3].completion_ids == finished[3].completion_ids  # the same samples beside other jobs or alone


@pytest.mark.process  # (the engine wraps its steps in torch.compile, which compiles at their first call)
def test_a_worker_building_the_engine_says_its_slots_and_cache(tmp_path, monkeypatch, caplog):
    from worker.decoding.build import build_decoder

    monkeypatch.setattr(ContinuousDecoding, "warm_up", lambda self, prompt_ids: 0.0)  # (not compiled here)
    trainer = trainer_for(tmp_path, worker_decoding="continuous", max_completion_length=24)
    with caplog.at_level("INFO"):
        decoding = build_decoder(trainer.args, trainer, 1, Events())
    assert isinstance(decoding, ContinuousDecoding)
    [line] = [r.getMessage() for r in caplog.records if "compiling its decoding step" in r.getMessage()]
    slots = decoding.slots
    assert f"(continuous, batch {slots} rows, cache {decoding.prompt_part + 24} tokens)" in line, line
    decoding.undo()


@pytest.mark.process
def test_where_the_engine_does_not_apply_the_worker_decodes_as_graph_and_says_why(tmp_path, monkeypatch, caplog):
    from worker.decoding.build import build_decoder
    from worker.decoding.graph import GraphDecoding

    monkeypatch.setattr(GraphDecoding, "warm_up", lambda self, prompt_ids: 0.0)  # (not compiled here)
    trainer = trainer_for(tmp_path, worker_decoding="continuous", max_staleness=0)
    decoding = build_decoder(trainer.args, trainer, 1, Events())
    assert isinstance(decoding, GraphDecoding)
    lines = [r.getMessage() for r in caplog.records if "instead of continuous batching" in r.getMessage()]
    assert len(lines) == 1 and "synchronous mode" in lines[0], lines
    decoding.undo()
