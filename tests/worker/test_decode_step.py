"""The worker's own decoding step (worker/decoding/graph.py, ``--worker_decoding graph``): what is its own, beside
what every decoder must do (tests/worker/test_decoders.py): the tokens of a larger shape and of TRL's padding to a
multiple against transformers' ``generate``, rows that all end early, packed grouped-query attention, the compiled
prefill's cache, an adapter sync, sampling against torch.multinomial over transformers' warpers (the distribution),
and the settings it does not implement.

The step runs eagerly (``compile=False``: the same function) where a test is about what it computes; one compiled
decoder (compiling takes seconds here) is shared by the module, and each test leaves its weights as it found them.
"""

from __future__ import annotations

from contextlib import closing
from types import SimpleNamespace

import pytest
import torch
from helpers.decoding import (
    DRAWS,
    GREEDY,
    NO_WARPER,
    SAMPLING,
    SETTINGS,
    Events,
    assert_captured_within_bf16_of_trls,
    assert_drawn_from,
    counted,
    decoded,
    expected_probs,
    generated,
    gpu_trainer,
    llama,
    prompt_ids,
    trainer_for,
    two_jobs,
)
from transformers.integrations.sdpa_attention import repeat_kv

from asyncgrpo.run import RunDir
from asyncgrpo.weights import make_publisher, make_subscriber
from worker.decoding.attention import PACKED_SDPA, sdpa_gqa_packed
from worker.decoding.compiled import CompiledDecoding
from worker.decoding.eager import EagerDecoding
from worker.decoding.graph import DONE_CHECK_EVERY, GraphDecoding
from worker.decoding.shapes import column_buckets
from worker.decoding.step import Sampling, sample
from worker.generate import generate_jobs

pytestmark = pytest.mark.filterwarnings("ignore")

def dataset_prompt_ids(trainer):
    return prompt_ids(trainer, [row["prompt"] for row in trainer.train_dataset])


def warmed_up(trainer, jobs_per_generate: int, **options) -> tuple:
    """(trainer, its compiled GraphDecoding for ``jobs_per_generate`` jobs a call, warmed up)."""
    decoding = GraphDecoding(trainer, jobs_per_generate, dataset_prompt_ids(trainer), **options)
    decoding.warm_up(dataset_prompt_ids(trainer))
    return trainer, decoding


@pytest.fixture(scope="module")
def greedy_compiled(tmp_path_factory):
    # The prefill compiled too (as on a GPU): one graph for every prompt width.
    return warmed_up(trainer_for(tmp_path_factory.mktemp("greedy"), **GREEDY), 1, compile_prefill=True)


# ---------------------------------------------------------------- the tokens: greedy decoding is generate's

# Every decoder's greedy tokens, with and without a repetition penalty: tests/worker/test_decoders.py. Here what is the
# step's own: a larger shape, and TRL's padding to a multiple.
@pytest.mark.parametrize(("shape", "settings"), [("larger", {}), ("demo", {"pad_to_multiple_of": 8})])
def test_greedy_decoding_gives_the_tokens_of_transformers_generate(tmp_path, shape, settings):
    trainer = trainer_for(tmp_path, llama(shape), **{**GREEDY, **settings})
    ids = prompt_ids(trainer)
    decoding = GraphDecoding(trainer, 1, ids, compile=False)
    expected = generated(trainer, ids)
    assert decoded(decoding, ids) == expected
    lengths = [len(c) for c in expected]
    # The cases that matter are all there: rows ending early (an EOS in the middle) and rows that never end.
    assert min(lengths) < trainer.max_completion_length and max(lengths) == trainer.max_completion_length
    assert all(c[-1] == 2 for c in expected if len(c) < trainer.max_completion_length)


def test_when_every_row_ends_early_the_loop_stops_and_the_completions_are_generates(tmp_path):
    trainer = trainer_for(tmp_path, llama(eos_bias=30.0), generation_kwargs={"do_sample": False},
                          max_completion_length=64)
    ids = prompt_ids(trainer)
    decoding = GraphDecoding(trainer, 1, ids, compile=False)
    steps = counted(trainer, decoding, "_compiled_step")
    expected = generated(trainer, ids)
    assert decoded(decoding, ids) == expected
    assert max(len(c) for c in expected) < DONE_CHECK_EVERY  # every row ended before the first check
    assert len(steps) == DONE_CHECK_EVERY  # the check after step 16 stopped it: not run to step 63


@pytest.mark.parametrize("mask_heads", [1, 8])
def test_a_tokens_query_heads_packed_onto_their_key_value_heads_attend_as_after_repeating_them(mask_heads):
    torch.manual_seed(0)
    query, key, value = torch.randn(3, 8, 1, 16), torch.randn(3, 2, 10, 16), torch.randn(3, 2, 10, 16)
    mask = torch.rand(3, mask_heads, 1, 10) > 0.4
    mask[..., 0] = True
    expected = torch.nn.functional.scaled_dot_product_attention(query, repeat_kv(key, 4), repeat_kv(value, 4),
                                                                attn_mask=mask).transpose(1, 2)
    out, _ = sdpa_gqa_packed(SimpleNamespace(num_key_value_groups=4), query, key, value, mask, scaling=None)
    torch.testing.assert_close(out, expected)


def test_with_grouped_query_attention_the_step_packs_the_heads_and_decodes_generates_tokens(tmp_path):
    # Run eagerly: the function is the same in the compiled step, and a compilation here would count as a
    # recompile of the module's compiled decoders (compiled_graphs counts the process's graphs).
    trainer = trainer_for(tmp_path, llama(kv_heads=2), **GREEDY)
    ids = prompt_ids(trainer)
    expected = generated(trainer, ids)  # transformers' own sdpa attention
    decoding = GraphDecoding(trainer, 1, ids, compile=False)
    assert decoding.model.config._attn_implementation == PACKED_SDPA
    assert decoded(decoding, ids) == expected


@pytest.mark.process
def test_the_compiled_prefill_writes_into_a_cache_allocated_outside_the_graph(greedy_compiled, monkeypatch):
    """CUDA graphs write into the cache in place only when its tensors' addresses are marked static, which
    transformers does only where it allocates them outside a compiled region: the first prefill into a cache runs
    eagerly, the later ones compiled."""
    trainer, decoding = greedy_compiled
    layers = decoding.cache.layers
    assert all(getattr(layer.keys, "_dynamo_static_input_type", None) for layer in layers)
    addresses = [layer.keys.data_ptr() for layer in layers]
    prefills, compiled = [], decoding._compiled_prefill
    monkeypatch.setattr(decoding, "_compiled_prefill", lambda *args: prefills.append(1) or compiled(*args))
    ids = prompt_ids(trainer)
    assert decoded(decoding, ids) == generated(trainer, ids)
    assert len(prefills) == 1 and [layer.keys.data_ptr() for layer in layers] == addresses


def test_the_steps_buckets_of_columns_cover_the_cache_in_equal_parts():
    assert column_buckets(16, 24, 4) == [32, 40]  # parts of 16 columns at least
    assert column_buckets(16, 64, 4) == [32, 48, 64, 80]
    assert column_buckets(32, 4096, 4) == [1056, 2080, 3104, 4128]
    assert column_buckets(32, 4096, 1) == [4128]  # the whole cache


@pytest.mark.process
def test_reading_only_the_written_columns_decodes_the_tokens_and_log_probs_of_reading_the_whole_cache(tmp_path,
                                                                                                   monkeypatch):
    """A completion that runs through every bucket of columns: the same tokens and behaviour log-probs as the step
    that reads the whole cache at every step, and no graph compiled after the warm-up, even where the warm-up's own
    calls ended before the later buckets."""
    trainer = trainer_for(tmp_path, **{**SAMPLING, "max_completion_length": 64})
    ids = prompt_ids(trainer)
    whole = GraphDecoding(trainer, 1, ids, attention_buckets=1)
    whole.warm_up(ids)
    bucketed = GraphDecoding(trainer, 1, ids)
    with monkeypatch.context() as warm_up_calls_end_at_once:
        warm_up_calls_end_at_once.setattr(bucketed, "max_new", 2)  # (as if every row's first token were an EOS)
        bucketed.warm_up(ids)
    assert len(bucketed.buckets) == 4 and whole.buckets == bucketed.buckets[-1:]
    for seed in (0, 1):
        results = []
        for decoding in (whole, bucketed):
            torch.manual_seed(seed)
            with torch.no_grad():
                results.append(decoding.decode_batch(decoding.pad_batch(ids)))
        (expected, tokens, logps), (completions, bucketed_tokens, bucketed_logps) = results
        assert completions == expected
        assert torch.equal(bucketed_tokens, tokens) and torch.equal(bucketed_logps, logps)
        assert max(len(c) for c in completions) == 64  # a row ran through the last bucket
    assert bucketed.recompiles() == 0


def test_an_adapter_sync_reaches_the_step(tmp_path):
    """LoRA: the worker decodes with the base model and the adapter layers in it; a synced adapter changes the
    tokens exactly as generate's."""
    overrides = {**GREEDY, "use_peft": True, "lora_r": 8, "lora_target_modules": "all-linear",
                 "lora_modules_to_save": ["lm_head"]}
    ps, worker = trainer_for(tmp_path / "ps", **overrides), trainer_for(tmp_path / "worker", **overrides)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a trained-looking adapter (a fresh one is a no-op)
        for p in ps.model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    ids = prompt_ids(worker)
    decoding = GraphDecoding(worker, 1, ids, compile=False)
    before = decoded(decoding, ids)
    run = RunDir.create(tmp_path / "run")
    with closing(make_publisher(run, ps.model, "mmap")) as publisher, closing(make_subscriber(run)) as sub:
        publisher.publish(version=1, step=1)
        assert sub.sync(worker.model) == 1
    after = decoded(decoding, ids)
    assert after == generated(worker, ids) == generated(ps, ids)
    assert after != before


# ---------------------------------------------------------------- the distribution: sampling is multinomial's

# Each setting eagerly; compiled once, with every warper (compiling costs seconds; the math is the same).
@pytest.mark.parametrize(("setting", "compiled"), [(name, False) for name in SETTINGS] +
                         [pytest.param("all", True, marks=pytest.mark.process)])
def test_sampling_draws_from_the_distribution_transformers_samples_from(setting, compiled):
    s = Sampling(**{**NO_WARPER, **SETTINGS[setting]})
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -4.0])
    want = expected_probs(logits, s)
    draw = torch.compile(sample, fullgraph=True, dynamic=False) if compiled else sample
    torch.manual_seed(0)
    tokens = draw(logits.expand(DRAWS, -1).contiguous(), s)
    assert_drawn_from(tokens, want)


def test_the_sampling_check_catches_a_wrong_distribution():
    """The test above fails when the sampler is off: top-p cut one token later than transformers cuts."""
    s = Sampling(**{**NO_WARPER, "top_p": 0.8})
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -4.0])
    torch.manual_seed(0)
    wrong = Sampling(**{**s.__dict__, "top_p": 0.9})
    counts = torch.bincount(sample(logits.expand(DRAWS, -1).contiguous(), wrong), minlength=10).double()
    want = expected_probs(logits, s)
    assert (counts[want == 0] > 0).any()


# ---------------------------------------------------------------- what the step does not implement

@pytest.mark.parametrize(("overrides", "why"), [
    ({"generation_kwargs": {"num_beams": 2}}, "num_beams > 1"),
    ({"generation_kwargs": {"no_repeat_ngram_size": 2}}, "no_repeat_ngram_size"),
    ({"generation_kwargs": {"sequence_bias": {"[3]": -5.0}}}, "sequence_bias"),
    ({"generation_kwargs": {"suppress_tokens": [3]}}, "suppress_tokens"),
])
@pytest.mark.process
def test_settings_the_step_does_not_implement_fall_back_to_compiled_generate(tmp_path, monkeypatch, caplog,
                                                                             overrides, why):
    from worker.decoding.build import build_decoder

    monkeypatch.setattr(CompiledDecoding, "warm_up", lambda self, prompt_ids: 0.0)  # (not compiled here)
    trainer = trainer_for(tmp_path, worker_decoding="graph", **overrides)
    decoding = build_decoder(trainer.args, trainer, 1, Events())
    assert isinstance(decoding, CompiledDecoding)
    lines = [r.getMessage() for r in caplog.records if "instead of its own decoding graph" in r.getMessage()]
    assert len(lines) == 1 and why in lines[0], lines
    decoding.undo()


@pytest.mark.process
def test_supported_settings_get_the_step(tmp_path, monkeypatch):
    from worker.decoding.build import build_decoder

    monkeypatch.setattr(GraphDecoding, "warm_up", lambda self, prompt_ids: 0.0)
    trainer = trainer_for(tmp_path, worker_decoding="graph", temperature=0.8, top_k=5, top_p=0.9, min_p=0.05,
                          repetition_penalty=1.1, generation_kwargs={"min_new_tokens": 2})
    assert GraphDecoding.unsupported(trainer) is None
    assert isinstance(build_decoder(trainer.args, trainer, 1, Events()), GraphDecoding)


def test_a_model_whose_forward_takes_no_cache_keyword_falls_back(tmp_path):
    """An older transformers names the cache past_key_values: given cache=, its models would swallow the keyword into
    their **kwargs and decode every step without the tokens before (no error, wrong tokens)."""
    from worker.decoding.continuous import ContinuousDecoding

    trainer = trainer_for(tmp_path)
    assert GraphDecoding.unsupported(trainer) is None
    model = trainer.model
    model.forward = lambda input_ids=None, past_key_values=None, **kwargs: type(model).forward(  # noqa: E731
        model, input_ids, past_key_values=past_key_values, **kwargs)
    for decoder in (GraphDecoding, ContinuousDecoding):
        assert "takes no cache=" in decoder.unsupported(trainer)


def test_auto_picks_the_step_on_cuda_and_continuous_batching_run_eagerly_on_cpu(tmp_path, caplog, monkeypatch):
    """On a CPU the engine, nothing compiled, said in one line; for a model too small for it, or where it does not
    apply, TRL's generate (what auto decoded with before), with the reason."""
    from worker.decoding.build import AUTO_ON_CPU, build_decoder, compiles, resolve_mode
    from worker.decoding.compiled_step import compiled_graphs
    from worker.decoding.continuous import ContinuousDecoding
    from worker.decoding.slot_runner import SlotRunner

    assert resolve_mode("auto", "cuda") == "graph"
    assert resolve_mode("auto", "cpu") == "continuous"
    trainer = trainer_for(tmp_path, llama("larger"))  # (2.4M parameters)
    assert trainer.args.worker_decoding == "auto" and not compiles(trainer.args)
    graphs = compiled_graphs()
    with caplog.at_level("INFO", logger="asyncgrpo.worker"):
        decoding = build_decoder(trainer.args, trainer, 1, Events())
    assert isinstance(decoding, ContinuousDecoding) and not decoding.runner.compiles
    assert compiled_graphs() == graphs and decoding.empty()  # (its trial job dropped)
    said = [r.getMessage() for r in caplog.records]
    assert any(line.startswith(f"[gen] dev1 decodes with {AUTO_ON_CPU}: ") for line in said), said
    # An engine that cannot run the model fails its trial job at the start: TRL's generate then, saying why.
    monkeypatch.setattr(SlotRunner, "_step", lambda *args: (_ for _ in ()).throw(RuntimeError("the engine broke")))
    caplog.clear()
    with caplog.at_level("INFO", logger="asyncgrpo.worker"):
        assert isinstance(build_decoder(trainer.args, trainer, 1, Events()), EagerDecoding)
    assert "[gen] dev1 continuous decoding failed its trial job (RuntimeError: the engine broke); decoding eagerly" \
        in [r.getMessage() for r in caplog.records]
    monkeypatch.undo()
    tiny = llama()
    for overrides, why in ((dict(model=tiny), f"a model of {tiny.num_parameters():,} parameters, whose decoding step "
                            "on a CPU costs less than the engine's own bookkeeping (the engine pays from 1,000,000)"),
                           (dict(model=llama("larger"), max_staleness=0), "synchronous mode (--max_staleness 0: a "
                            "job is generated by one version)")):
        other = trainer_for(tmp_path, **overrides)
        caplog.clear()
        with caplog.at_level("INFO", logger="asyncgrpo.worker"):
            assert isinstance(build_decoder(other.args, other, 1, Events()), EagerDecoding)
        assert [r.getMessage() for r in caplog.records] == [
            f"[gen] dev1 decodes with TRL's generate (--worker_decoding auto), not continuous batching: {why}"]
    assert compiles(trainer_for(tmp_path, worker_decoding="continuous").args)
    # Asked for on a model too small for it: it runs, saying what auto would do (stopped here as it is made: its
    # compiling is another test's).
    asked = trainer_for(tmp_path, model=tiny, worker_decoding="continuous")
    monkeypatch.setattr(ContinuousDecoding, "__init__", lambda *args, **kwargs: (_ for _ in ()).throw(
        RuntimeError("stop")))
    caplog.clear()
    with caplog.at_level("INFO", logger="asyncgrpo.worker"), pytest.raises(RuntimeError, match="stop"):
        build_decoder(asked.args, asked, 1, Events())
    assert ("[gen] dev1 decodes with continuous batching as asked, though TRL's generate is faster here "
            f"(--worker_decoding auto picks it): a model of {tiny.num_parameters():,} parameters, whose decoding step "
            "on a CPU costs less than the engine's own bookkeeping (the engine pays from 1,000,000)"
            ) in [r.getMessage() for r in caplog.records]
    monkeypatch.undo()
    # A CPU's engine holds as many jobs' rows as a call would take: --jobs_per_generate's.
    three = trainer_for(tmp_path, llama("larger"), jobs_per_generate=3)
    assert build_decoder(three.args, three, 1, Events()).slots == 3 * three.args.generation_batch_size


# ---------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_step_on_the_gpu_with_cuda_graphs_captures_log_probs_within_bf16_tolerance(tmp_path):
    trainer, decoding = warmed_up(gpu_trainer(tmp_path), 2)
    outcomes = generate_jobs(trainer, two_jobs(trainer), Events(), decoding)
    assert decoding.recompiles() == 0
    assert_captured_within_bf16_of_trls(trainer, outcomes)


def test_a_min_p_of_zero_filters_nothing():
    """transformers takes min_p 0 as no filter; the step must not take log(0) of it."""
    from transformers import GenerationConfig

    s = Sampling.of(GenerationConfig(do_sample=True, min_p=0.0))
    assert s.min_p is None
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    assert sample(logits, s).shape == (1,)
