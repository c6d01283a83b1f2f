"""The TRL internals asyncgrpo relies on (trl 1.16), and the transformers generation loop behaviour log-probs are
captured from. When they change, this fails and names what.

Each method ps/trainer.py or worker/generate.py overrides or calls is checked with inspect.signature
against the way asyncgrpo calls it (parameter names, order, defaults, **kwargs), and called: on a tiny
GRPOTrainer built in process (the demo's model, tokenizer and config; no download), each test asserts
what ps/ and worker/ need of its behaviour, so that a change in what TRL or transformers does fails here,
not only a change in how their source reads.

One file on purpose, longer than a module should be: it is the list of everything asyncgrpo assumes of TRL and
transformers, read in one place when either is upgraded."""

import ast
import contextlib
import dataclasses
import inspect
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import trl
from helpers import REPO, demo_config
from packaging.version import Version
from transformers import GenerationMixin, TrainerCallback
from transformers.trainer_callback import ProgressCallback, TrainerControl, TrainerState
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler

from asyncgrpo.events import EventLog
from asyncgrpo.jobqueue.handoff import REWARDS_KEY
from asyncgrpo.peft_args import PeftArgs
from asyncgrpo.tasks.demo import build_dataset, build_model, build_tokenizer, repeat_digit_reward, write_demo_model
from worker.behaviour import BehaviourCapture
from worker.decoding.compiled import COMPILED_CALL, LAST_COMPILE_CONFIG
from worker.generate import completion_logs, error_record, generate_and_score
from worker.trl_seam import BEHAVIOUR_LOGPS, GENERATE, GENERATE_AND_SCORE, GENERATE_SINGLE_TURN, TRL_INTERNALS

pytestmark = pytest.mark.filterwarnings("ignore")

P = inspect.Parameter
REQUIRED = P.empty  # a parameter the callers always pass
ANY = object()  # a parameter with a default the callers may pass or leave out: any default
POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)


# The TRL / transformers methods ps/trainer.py and worker/generate.py override or call, and how:
# (the parameters asyncgrpo passes, in order, as (name, default): REQUIRED when the caller always
# passes it, ANY when it may leave it out; whether **kwargs must be accepted). Every further
# parameter must have a default, so that asyncgrpo's calls still bind and its overrides still fit.
# KEYWORDS: methods called by keyword only, where the order does not matter.
KEYWORDS = "keywords"
SIGNATURES = {
    # ps/trainer.py: AsyncGRPOTrainer(...) -> GRPOTrainer.__init__(model=..., reward_funcs=..., ...);
    # worker/generate.py: build_trainer, the same keywords
    (GRPOTrainer, "__init__"): ([("self", REQUIRED), ("model", REQUIRED), ("reward_funcs", ANY), ("args", ANY),
                                 ("train_dataset", ANY), ("eval_dataset", ANY), ("processing_class", ANY),
                                 ("peft_config", None), ("tools", None), ("rollout_func", None),
                                 ("environment_factory", None)], KEYWORDS),
    # worker/behaviour.py MultiTurnCapture: each turn's log-probs go in and come out of TRL's tool loop, extended
    # across turns as the completion ids are (tests/worker/test_multi_turn.py checks the values)
    (GRPOTrainer, "_tool_call_loop"): ([("self", REQUIRED), ("prompts", REQUIRED), ("prompt_ids", REQUIRED),
                                        ("completion_ids", REQUIRED), ("completions", REQUIRED),
                                        ("logprobs", REQUIRED), ("images", REQUIRED),
                                        ("multimodal_fields", REQUIRED)], False),
    # ps/trainer.py overrides train(resume_from_checkpoint=None, **kwargs); ps/__main__.py passes a path or None
    (GRPOTrainer, "train"): ([("self", REQUIRED), ("resume_from_checkpoint", None)], False),
    # PS override (training: the pipeline's result; evaluation: super()); the worker calls it with a job's rows
    (GRPOTrainer, GENERATE_AND_SCORE): ([("self", REQUIRED), ("inputs", REQUIRED)], False),
    # TRL's own, unchanged, calls the override above
    (GRPOTrainer, "_prepare_inputs"): ([("self", REQUIRED), ("generation_batch", REQUIRED)], False),
    # PS override: super()._compute_loss(model, inputs) with per-token advantages
    (GRPOTrainer, "_compute_loss"): ([("self", REQUIRED), ("model", REQUIRED), ("inputs", REQUIRED)], False),
    # PS override (passes everything through, unpacks 3 values); the worker and the PS's proximal log-probs
    # call it as (model, input_ids, attention_mask, logits_to_keep, batch_size=...)
    (GRPOTrainer, BEHAVIOUR_LOGPS): ([("self", REQUIRED), ("model", REQUIRED), ("input_ids", REQUIRED),
                                      ("attention_mask", REQUIRED), ("logits_to_keep", REQUIRED),
                                      ("batch_size", ANY)], False),
    # the worker wraps it with (*args, **kwargs) to time generation apart from scoring
    (GRPOTrainer, GENERATE): ([("self", REQUIRED), ("prompts", REQUIRED)], False),
    # worker/generate.py generate_jobs: several jobs' prompts tokenized as TRL's _generate does, generated in one
    # call; each job's own _generate then gets its share from a replacement taking the same arguments
    (GRPOTrainer, "_tokenize_prompts"): ([("self", REQUIRED), ("prompts", REQUIRED)], False),
    (GRPOTrainer, GENERATE_SINGLE_TURN): ([("self", REQUIRED), ("prompt_ids", REQUIRED), ("images", REQUIRED),
                                          ("multimodal_fields", REQUIRED), ("num_generations", REQUIRED)], False),
    # PS override: log(logs, start_time=None) -> super().log(logs, start_time)
    (GRPOTrainer, "log"): ([("self", REQUIRED), ("logs", REQUIRED), ("start_time", None)], False),
    # PS override: super()._save_checkpoint(model, trial), then the ledger into the folder it names
    (GRPOTrainer, "_save_checkpoint"): ([("self", REQUIRED), ("model", REQUIRED), ("trial", REQUIRED)], False),
    (GRPOTrainer, "_get_output_dir"): ([("self", REQUIRED), ("trial", REQUIRED)], False),
    # ps/__main__.py: a relaunch with nothing left to train loads the newest checkpoint's weights before the final save
    (GRPOTrainer, "_load_from_checkpoint"): ([("self", REQUIRED), ("resume_from_checkpoint", REQUIRED)], False),
    # PS override: the hyperparameters of the relaunch's flags put back after super() loads the checkpoint's
    (GRPOTrainer, "_load_optimizer_and_scheduler"): ([("self", REQUIRED), ("checkpoint", REQUIRED)], False),
    (GRPOTrainer, "add_callback"): ([("self", REQUIRED), ("callback", REQUIRED)], False),
    # ps/trainer.py's _PipelineCallback
    (TrainerCallback, "on_train_begin"): ([("self", REQUIRED), ("args", REQUIRED), ("state", REQUIRED),
                                           ("control", REQUIRED)], True),
    (TrainerCallback, "on_step_begin"): ([("self", REQUIRED), ("args", REQUIRED), ("state", REQUIRED),
                                          ("control", REQUIRED)], True),
    (TrainerCallback, "on_step_end"): ([("self", REQUIRED), ("args", REQUIRED), ("state", REQUIRED),
                                        ("control", REQUIRED)], True),
    # worker/generate.py's BehaviourCapture wraps model.generate and reads input_ids from its keywords
    (GenerationMixin, "generate"): ([("self", REQUIRED), ("inputs", None)], True),
    # ps/producer.py draws jobs with it, by keyword
    (RepeatSampler, "__init__"): ([("self", REQUIRED), ("data_source", REQUIRED), ("mini_repeat_count", REQUIRED),
                                   ("batch_size", ANY), ("repeat_count", ANY), ("shuffle", ANY), ("seed", ANY)],
                                  False),
}


def signature_problems(func, expected, needs_kwargs) -> list[str]:
    """What in ``func``'s signature breaks the calls asyncgrpo makes (empty: nothing).
    ``needs_kwargs``: True (must take **kwargs), False, or KEYWORDS (``expected`` is passed by name)."""
    parameters = list(inspect.signature(func).parameters.values())
    by_name = {p.name: p for p in parameters}
    problems = []
    for i, (name, default) in enumerate(expected):
        if needs_kwargs == KEYWORDS and i > 0:  # self stays first; the rest are found by name
            param = by_name.get(name)
            if param is None or param.kind not in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY):
                problems.append(f"no keyword parameter {name}")
                continue
        elif i >= len(parameters) or parameters[i].name != name:
            found = parameters[i].name if i < len(parameters) else "nothing"
            problems.append(f"parameter {i} is {found}, expected {name}")
            continue
        else:
            param = parameters[i]
            if param.kind not in POSITIONAL:
                problems.append(f"{name} is {param.kind.description}, expected positional or keyword")
        if default is REQUIRED:
            continue
        if param.default is P.empty:
            problems.append(f"{name} has no default")
        elif default is not ANY and param.default != default:
            problems.append(f"{name} defaults to {param.default!r}, expected {default!r}")
    names = {name for name, _ in expected}
    for param in parameters:
        if param.name not in names and param.default is P.empty and param.kind not in (P.VAR_POSITIONAL,
                                                                                       P.VAR_KEYWORD):
            problems.append(f"new required parameter {param.name}")
    if needs_kwargs is True and not any(p.kind is P.VAR_KEYWORD for p in parameters):
        problems.append("no longer accepts **kwargs")
    return problems


@pytest.mark.parametrize("owner, name", list(SIGNATURES), ids=[f"{o.__name__}.{n}" for o, n in SIGNATURES])
def test_signatures_of_the_methods_asyncgrpo_overrides_or_calls(owner, name):
    func = getattr(owner, name, None)
    assert callable(func), f"{owner.__name__}.{name} is gone"
    leading, needs_kwargs = SIGNATURES[owner, name]
    problems = signature_problems(func, leading, needs_kwargs)
    assert not problems, f"{owner.__name__}.{name}{inspect.signature(func)} changed: {'; '.join(problems)}"


def test_the_signature_check_can_fail():
    """The checker itself, on made-up signatures: a renamed, a reordered, a new required parameter, a
    default that changed, a lost **kwargs."""
    leading = [("self", REQUIRED), ("logs", REQUIRED), ("start_time", None)]
    assert signature_problems(lambda self, logs, start_time=None, extra=1: None, leading, False) == []
    assert signature_problems(lambda self, records, start_time=None: None, leading, False)
    assert signature_problems(lambda self, start_time=None, logs=None: None, leading, False)
    assert signature_problems(lambda self, logs, start_time=None, *, step: None, leading, False)
    assert signature_problems(lambda self, logs, start_time=0.0: None, leading, False)
    assert signature_problems(lambda self, logs, *, start_time=None: None, leading, False)
    assert signature_problems(lambda self, logs, start_time=None: None, leading, True)
    by_keyword = [("self", REQUIRED), ("model", REQUIRED), ("args", ANY)]
    assert signature_problems(lambda self, args=None, model=None: None, by_keyword, KEYWORDS) == []
    assert signature_problems(lambda self, model, config=None: None, by_keyword, KEYWORDS)
    assert signature_problems(lambda self, model, /, args=None: None, by_keyword, KEYWORDS)


def test_trainer_state_and_control_fields_the_ps_reads():
    assert {"global_step", "max_steps"} <= {f.name for f in dataclasses.fields(TrainerState)}, (
        "TrainerState.global_step / max_steps are gone (the PS's weights versions and checkpoint placement)")
    assert "should_save" in {f.name for f in dataclasses.fields(TrainerControl)}, (
        "TrainerControl.should_save is gone (the PS moves a save that falls inside a batch to its last step)")


def test_the_progress_bar_the_ps_shows_reward_and_staleness_on(tmp_path):
    """ps/trainer.py finds transformers' ProgressCallback's training_bar (None until training starts) and sets
    its postfix."""
    progress, state = ProgressCallback(), TrainerState(max_steps=3, is_world_process_zero=True)
    assert progress.training_bar is None
    args = demo_config(tmp_path)
    progress.on_train_begin(args, state, TrainerControl())
    try:
        progress.training_bar.set_postfix(reward="0.500", staleness="1.0", refresh=False)
        assert "reward=0.500" in progress.training_bar.postfix
    finally:
        progress.on_train_end(args, state, TrainerControl())


def test_trl_version_is_in_the_pinned_range():
    assert Version("1.16") <= Version(trl.__version__) < Version("1.17"), (
        f"trl {trl.__version__} is outside the range ps/ and worker/ were written against (1.16.x)")


# ---------------------------------------------------------------------- TRL's trainer, called

# The calls below run TRL's own code on a tiny GRPOTrainer: the demo's model, tokenizer and config, 2 prompts x 4
# generations of at most 6 tokens, temperature 0.7 (so that dividing by it shows), a reward function that logs an
# extra column of the completions table and an async one (TRL calls them on two paths).
G, PROMPTS, TEMPERATURE = 4, 2, 0.7


def digits_logging_length(prompts, completions, log_extra, **kwargs):
    log_extra("length", [len(c) for c in completions])
    return repeat_digit_reward(prompts, completions)


async def async_length(completions, **kwargs):
    return [len(c) / 6 for c in completions]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    cfg = demo_config(tmp_path_factory.mktemp("trl"), per_device_train_batch_size=G * PROMPTS, num_generations=G,
                      max_completion_length=6, temperature=TEMPERATURE)
    tok = build_tokenizer()
    trainer = GRPOTrainer(model=build_model(seed=0, tokenizer=tok), reward_funcs=[digits_logging_length, async_length],
                          args=cfg, train_dataset=build_dataset(n=20, seed=0), processing_class=tok)
    trainer.model.train()  # as the worker holds it (TRL's train-mode names), and the PS while it trains
    return trainer


def job_rows(trainer) -> list[dict]:
    """One generation batch as the PS's producer draws it: each prompt's row num_generations times in a row."""
    return [trainer.train_dataset[i // G] for i in range(G * PROMPTS)]


@contextlib.contextmanager
def replaced(obj, name: str, value):
    """``obj.name`` is ``value`` inside the block (an instance attribute, as the worker and PS set them)."""
    own = vars(obj)
    had, old = name in own, own.get(name)
    setattr(obj, name, value)
    try:
        yield value
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def recording(calls: list, method):
    """``method``, appending each call's (args, kwargs, result) to ``calls``."""

    def record(*args, **kwargs):
        out = method(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    return record


def forward_logps(trainer, batch, model=None, **kwargs) -> torch.Tensor:
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = getattr(trainer, BEHAVIOUR_LOGPS)(model or trainer.model, ids, mask,
                                                        batch["completion_ids"].size(1), **kwargs)
    return logps


def test_generate_and_score_returns_the_batch_the_ps_trains_on_in_the_jobs_row_order(trainer):
    """One _generate call per job (workers time generation apart from scoring by wrapping it); TRL's batch holds
    the keys the PS trains on, row i being the job's row i (left-padded prompt, right-padded completion as
    generated), advantages normalised within each prompt's group; without old_per_token_logps when the steps are
    aligned (the worker supplies them); TRL's metrics of the job in _metrics["train"] (the worker reads them)."""
    rows, calls = job_rows(trainer), []
    trainer._metrics["train"].clear()
    with replaced(trainer, GENERATE, recording(calls, getattr(trainer, GENERATE))), torch.no_grad():
        batch = getattr(trainer, GENERATE_AND_SCORE)(rows)
    assert len(calls) == 1, f"GRPOTrainer.{GENERATE_AND_SCORE} called {GENERATE} {len(calls)} times for one job"
    prompt_ids, completion_ids = calls[0][2][:2]
    assert {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
            "num_items_in_batch"} <= set(batch), sorted(batch)
    assert "old_per_token_logps" not in batch, "TRL computed old_per_token_logps with aligned steps"
    n = len(rows)
    assert batch["prompt_ids"].shape == batch["prompt_mask"].shape and batch["prompt_ids"].size(0) == n
    assert batch["completion_ids"].shape == batch["completion_mask"].shape == (n, max(map(len, completion_ids)))
    assert batch["advantages"].shape == (n,)
    assert int(batch["num_items_in_batch"]) == int(batch["completion_mask"].sum())
    tok = trainer.processing_class
    for i, row in enumerate(rows):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        assert prompt == list(prompt_ids[i]) and tok.decode(prompt) == row["prompt"], i
        assert prompt == batch["prompt_ids"][i, -len(prompt):].tolist(), f"row {i}: the prompt is not left-padded"
        width = int(batch["completion_mask"][i].sum())
        assert batch["completion_ids"][i, :width].tolist() == list(completion_ids[i]), f"row {i}: not generated row {i}"
        assert batch["completion_mask"][i, :width].all(), f"row {i}: the completion is not right-padded"
    torch.testing.assert_close(batch["advantages"].view(PROMPTS, G).sum(dim=1), torch.zeros(PROMPTS), atol=1e-4,
                               rtol=0)
    # (and the PS's warnings read these: ps/learning_signal.py)
    assert {"reward", "reward_std", "frac_reward_zero_std", "completions/clipped_ratio"} <= set(
        trainer._metrics["train"]), sorted(trainer._metrics["train"])


def test_trl_brings_old_logps_only_when_generation_and_optimizer_steps_misalign(trainer):
    """A worker's trainer is built with aligned steps so that TRL leaves old_per_token_logps to it; the PS's, with
    several steps per job (--num_iterations), gets them from TRL: the log-probs of the weights of the take."""
    with replaced(trainer, "num_iterations", 2), torch.no_grad():
        batch = getattr(trainer, GENERATE_AND_SCORE)(job_rows(trainer))
    assert "old_per_token_logps" in batch, "TRL no longer computes old_per_token_logps for --num_iterations 2"
    on = batch["completion_mask"].bool()
    torch.testing.assert_close(batch["old_per_token_logps"][on], forward_logps(trainer, batch)[on])


def fake_batch(rows: int) -> dict:
    return {"prompt_ids": torch.ones(rows, 2, dtype=torch.long), "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
            "completion_ids": torch.ones(rows, 3, dtype=torch.long),
            "completion_mask": torch.ones(rows, 3, dtype=torch.long),
            "advantages": torch.arange(rows, dtype=torch.float), "num_items_in_batch": torch.tensor(3 * rows)}


def test_prepare_inputs_trains_and_evaluates_on_what_the_overridden_method_returns(trainer):
    """The PS replaces _generate_and_score_completions (a worker's result in training, TRL's own in evaluation):
    TRL's _prepare_inputs must get its batch there, in both modes."""
    rows, calls = job_rows(trainer), []
    batch = fake_batch(len(rows))
    with replaced(trainer, GENERATE_AND_SCORE, recording(calls, lambda inputs: batch)), \
            replaced(trainer, "_step", 0), replaced(trainer, "_buffered_inputs", None):
        trained = trainer._prepare_inputs(rows)
        assert [c[0] for c in calls] == [(rows,)]
        assert sorted(trained["advantages"].tolist()) == batch["advantages"].tolist()  # the whole batch, shuffled
        trainer.model.eval()
        try:
            evaluated = trainer._prepare_inputs(rows)
        finally:
            trainer.model.train()
    assert len(calls) == 2 and evaluated is batch


def test_evaluation_generates_through_the_overridden_method(trainer):
    """--eval_strategy: TRL's prediction_step prepares (generates) its inputs, reaching the PS's override in
    eval mode, and returns the loss."""
    calls = []
    trainer.model.eval()
    try:
        with replaced(trainer, GENERATE_AND_SCORE, recording(calls, getattr(trainer, GENERATE_AND_SCORE))):
            loss, _, _ = trainer.prediction_step(trainer.model, job_rows(trainer), prediction_loss_only=True)
    finally:
        trainer.model.train()
    assert len(calls) == 1 and loss.dim() == 0 and torch.isfinite(loss)


def test_the_loss_takes_old_logps_as_the_ratio_s_denominator_and_masks_against_sampling_logps(trainer):
    """The PS hands TRL's loss the proximal (or, with --off_policy_correction none, the behaviour) log-probs as
    old_per_token_logps, and the behaviour log-probs as sampling_per_token_logps for off_policy_mask_threshold."""
    with torch.no_grad():
        batch = getattr(trainer, GENERATE_AND_SCORE)(job_rows(trainer))
    batch["advantages"] = torch.tensor([1.0, -1.0] * (len(job_rows(trainer)) // 2))
    logps = forward_logps(trainer, batch)

    def loss(**inputs):
        with torch.no_grad(), replaced(trainer, "current_gradient_accumulation_steps", 1):  # set by TRL's train()
            return trainer._compute_loss(trainer.model, {**batch, **inputs}).item()

    ratio_one = loss()  # without old_per_token_logps TRL takes the current log-probs: ratio 1
    assert loss(old_per_token_logps=logps) == pytest.approx(ratio_one, abs=1e-6)
    assert loss(old_per_token_logps=logps - 1.0) != pytest.approx(ratio_one, abs=1e-3), (
        "TRL's loss no longer depends on old_per_token_logps: stale samples would not be corrected")
    batch["advantages"] = -torch.ones(len(job_rows(trainer)))
    with replaced(trainer, "off_policy_mask_threshold", 0.5):
        kept, dropped = loss(sampling_per_token_logps=logps), loss(sampling_per_token_logps=logps + 2.0)
    assert kept != 0 and dropped == 0, (kept, dropped)


def test_the_reference_model_is_loaded_with_model_init_kwargs(tmp_path):
    """--beta > 0: TRL builds its reference model from the policy's path with args.model_init_kwargs (asyncgrpo
    sets them to how it loaded the policy), and warns that they are ignored for the policy it was handed, in
    words asyncgrpo's log filter recognises."""
    from transformers import AutoModelForCausalLM

    from asyncgrpo.inputs import _MODEL_INIT_KWARGS_APPLIED

    path = tmp_path / "model"
    write_demo_model(path)
    policy = AutoModelForCausalLM.from_pretrained(path)  # float32
    cfg = demo_config(tmp_path, beta=0.04, model_init_kwargs={"dtype": "bfloat16", "device_map": None})
    trl_log, records = logging.getLogger("trl.trainer.grpo_trainer"), []
    handler = logging.Handler()
    handler.emit = records.append
    trl_log.addHandler(handler)
    trl_log.removeFilter(_MODEL_INIT_KWARGS_APPLIED)  # asyncgrpo adds it once it loaded a model this way
    try:
        trainer = GRPOTrainer(model=policy, reward_funcs=[repeat_digit_reward], args=cfg,
                              train_dataset=build_dataset(n=20), processing_class=build_tokenizer())
    finally:
        trl_log.removeHandler(handler)
    assert trainer.ref_model is not None and trainer.ref_model.dtype == torch.bfloat16, "model_init_kwargs not used"
    saved = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert all(torch.equal(t.float(), saved[name].to(torch.bfloat16).float())
               for name, t in trainer.ref_model.state_dict().items()), "the reference is not the policy's saved model"
    assert [r for r in records if not _MODEL_INIT_KWARGS_APPLIED.filter(r)], (
        "TRL's warning that model_init_kwargs are ignored changed: asyncgrpo/inputs.py's filter no longer hides it "
        f"({[r.getMessage() for r in records]})")


def test_log_averages_the_metrics_the_ps_adds(trainer):
    """The PS appends the worker's metrics of the job in training to _metrics["train"]; TRL's log averages them
    into the logged line and starts again."""
    trainer._metrics["train"].clear()
    trainer._metrics["train"]["reward"].extend([0.25, 0.75])
    trainer.log({"loss": 1.5})
    assert {"loss": 1.5, "reward": 0.5}.items() <= trainer.state.log_history[-1].items(), trainer.state.log_history[-1]
    assert not trainer._metrics["train"]


def test_the_ps_keeps_the_newest_of_the_log_history_transformers_grows_at_every_log(trainer, monkeypatch):
    import ps.trainer
    from ps.step_record import StepRecord
    from ps.trainer import AsyncGRPOTrainer

    monkeypatch.setattr(ps.trainer, "LOG_HISTORY_KEPT", 5)
    ps_trainer = object.__new__(AsyncGRPOTrainer)  # the fixture's trainer, with the PS's log
    vars(ps_trainer).update(vars(trainer), step_record=StepRecord())
    kept = list(trainer.state.log_history)
    try:
        for loss in range(12):
            ps_trainer.log({"loss": float(loss)})
        assert [entry["loss"] for entry in trainer.state.log_history] == [7.0, 8.0, 9.0, 10.0, 11.0]
    finally:
        trainer.state.log_history[:] = kept


def test_the_completions_table_is_filled_while_scoring_and_written_by_log(trainer):
    """Workers send the rows TRL logged for its completions table while scoring (worker.generate.completion_logs),
    the PS puts them back where TRL's own generation would, and TRL's log writes them (--log_completions)."""
    from worker.generate import _clear_completion_logs

    _clear_completion_logs(trainer)
    with torch.no_grad():
        getattr(trainer, GENERATE_AND_SCORE)(job_rows(trainer))
    logs, n = completion_logs(trainer), len(job_rows(trainer))
    assert [len(logs[key]) for key in ("prompt", "completion", "advantages")] == [n, n, n]
    assert {name: len(values) for name, values in logs["rewards"].items()} == {
        "digits_logging_length": n, "async_length": n}
    assert {name: len(values) for name, values in logs["extra"].items()} == {"length": n}
    assert logs["prompt"] == [row["prompt"] for row in job_rows(trainer)]
    output_dir = Path(trainer.args.output_dir)
    (output_dir / "completions").mkdir(parents=True, exist_ok=True)  # TRL makes it at start-up with the flag on
    with replaced(trainer, "log_completions", True):
        trainer.log({"loss": 0.0})
    table = pd.read_parquet(output_dir / "completions" / f"completions_{trainer.state.global_step:05d}.parquet")
    assert len(table) == n and {"prompt", "completion", "digits_logging_length", "async_length", "length",
                                "advantage"} <= set(table.columns), list(table.columns)
    assert table["completion"].tolist() == logs["completion"]


@pytest.mark.parametrize("how", ["raises", "raises_async", "returns_too_few"])
def test_a_failed_job_names_the_reward_function_from_trl_s_frames(trainer, how):
    """worker.generate.error_record names the reward function from the locals of TRL's _calculate_rewards
    (reward_func_name, func_name on its async path), also when TRL raises about the function's output."""

    def raises(completions, **kwargs):
        raise ValueError("no reward")

    async def raises_async(completions, **kwargs):
        raise ValueError("no reward")

    def returns_too_few(completions, **kwargs):
        return [0.0] * (len(completions) - 1)

    rows = job_rows(trainer)
    completions = ["1111"] * len(rows)
    reward = {"raises": raises, "raises_async": raises_async, "returns_too_few": returns_too_few}[how]
    with replaced(trainer, "reward_funcs", [reward]), replaced(trainer, "reward_func_names", ["my_reward"]), \
            replaced(trainer, "reward_processing_classes", [None]):
        with pytest.raises(ValueError) as raised:
            trainer._calculate_rewards(rows, [r["prompt"] for r in rows], completions, [[5, 5, 5, 5]] * len(rows))
    assert error_record(raised.value)["reward_function"] == "my_reward", raised.value


def test_the_rewards_a_worker_sends_are_those_trl_normalises_into_advantages(trainer):
    """Dynamic sampling (ps/groups.py) judges each group by the rewards the worker captures from TRL's
    _calculate_rewards, weighted as TRL weights them; the PS pads assembled batches with TRL's tokenizer's pad."""
    rows = job_rows(trainer)
    # Unequal weights: advantages normalised within each group tell a weighted sum from an unweighted one.
    with replaced(trainer, "reward_weights", torch.tensor([0.5, 2.0])):
        batch, _ = generate_and_score(trainer, rows, EventLog.off(), seed=0)
    rewards = batch[REWARDS_KEY]
    assert rewards.shape == (len(rows),)
    grouped = rewards.view(PROMPTS, G)
    expected = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4)
    torch.testing.assert_close(batch["advantages"], expected.flatten(), atol=1e-5, rtol=1e-4)
    assert trainer._tokenizer.pad_token_id == trainer.processing_class.pad_token_id


# Generation: what the worker captures behaviour log-probs from (worker/behaviour.py) and shares between jobs
# (worker/generate.py generate_jobs).

def test_generation_settings_the_worker_reads(trainer):
    assert (trainer.use_vllm, trainer.use_transformers_continuous_batching, trainer.rollout_func) == (False, False,
                                                                                                    None)
    assert not trainer.tools
    assert trainer.temperature == trainer.generation_config.temperature == TEMPERATURE  # what the LM head divides by
    assert trainer.generation_config.disable_compile is True  # see worker/decoding/compiled.py
    assert BehaviourCapture.unsupported(trainer) is None


def test_generate_returns_the_log_probs_fifth_and_the_tool_dicts_are_the_batch_s(trainer):
    """worker/behaviour.py takes the log-probs out of _generate's output (index 4: TRL would read them as vLLM's
    sampling log-probs); worker/tools.py bounds the tools in the per-rollout dicts TRL builds before _generate."""
    source = inspect.getsource(inspect.unwrap(getattr(GRPOTrainer, GENERATE)))
    assert "return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images" \
        in source
    scoring = inspect.getsource(inspect.unwrap(getattr(GRPOTrainer, GENERATE_AND_SCORE)))
    assert scoring.index("self._sync_tool_dicts = []") < scoring.index("= self._generate(prompts)")
    assert "self._async_tool_dicts = []" in scoring
    assert "sampling_per_token_logps_list," in scoring


def test_environments_come_from_a_pool_and_the_factories_and_are_called_on_the_instance():
    """worker/tools.py bounding_environments: TRL draws each batch's environments from _environment_pool, making
    more with environment_factories, and calls reset() and get_reward() on the instance."""
    scoring = inspect.getsource(inspect.unwrap(getattr(GRPOTrainer, GENERATE_AND_SCORE)))
    assert "pool = self._environment_pool[name]" in scoring
    assert "pool.append(self.environment_factories[name]())" in scoring
    assert "observation = environment.reset(**reset_kwargs)" in scoring
    init = inspect.getsource(GRPOTrainer.__init__)
    assert "self._environment_pool[name] = [instance]" in init
    assert "return [e.get_reward() if type(e) is _env_type else None for e in environments]" in init


def test_generate_tokenizes_the_prompts_then_generates_them_in_one_single_turn_call(trainer):
    """What generate_jobs does for several jobs at once, and each job's _generate then replays: TRL's _generate
    tokenizes with _tokenize_prompts and takes its completions from one _generate_single_turn call."""
    prompts = [row["prompt"] for row in job_rows(trainer)]
    tokenized, single_turns = [], []
    completions = [[4 + i % 10, 5] for i in range(len(prompts))]
    with replaced(trainer, "_tokenize_prompts", recording(tokenized, trainer._tokenize_prompts)), \
            replaced(trainer, GENERATE_SINGLE_TURN, recording(single_turns, lambda *args: (completions, None))):
        prompt_ids, completion_ids = getattr(trainer, GENERATE)(prompts)[:2]
    assert [c[0] for c in tokenized] == [(prompts,)]
    assert [c[0] for c in single_turns] == [(tokenized[0][2][0], None, {}, G)]
    assert prompt_ids == tokenized[0][2][0] and completion_ids == completions


def test_single_turn_generation_is_one_generate_call_on_the_unwrapped_model(trainer):
    """BehaviourCapture wraps generate on accelerator.unwrap_model(trainer.model_wrapped) and reads the
    completions as generate's output after the left-padded prompts (cut after the first EOS)."""
    model, calls = trainer.accelerator.unwrap_model(trainer.model_wrapped), []
    prompt_ids = [list(ids) for ids in trainer._tokenize_prompts(["7:", "12 3:", "9 9 9 9:"])[0]]
    with replaced(model, "generate", recording(calls, model.generate)), torch.no_grad():
        completion_ids, logprobs = getattr(trainer, GENERATE_SINGLE_TURN)(prompt_ids, None, {}, G)
    assert len(calls) == 1, f"{GENERATE_SINGLE_TURN} called the model's generate {len(calls)} times"
    (args, kwargs, out) = calls[0]
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    width, pad = input_ids.size(1), trainer.processing_class.pad_token_id
    assert input_ids.tolist() == [[pad] * (width - len(ids)) + ids for ids in prompt_ids]
    eos = trainer.processing_class.eos_token_id
    expected = []
    for row in out[:, width:].tolist():
        expected.append(row[:row.index(eos) + 1] if eos in row else row)
    assert [list(c) for c in completion_ids] == expected and logprobs is None


def test_the_decoding_loop_samples_from_the_raw_last_position_logits():
    """BehaviourCapture keeps each decoding forward's last-position logits (a forward hook): those must be the
    logits generate samples from, before its processors (temperature, top-k, top-p, repetition penalty), one
    forward per new token, each forward after the first bringing the token sampled from the one before."""
    from transformers import GenerationConfig

    tok = build_tokenizer()
    model = build_model(seed=0, tokenizer=tok)
    forwards = []
    hook = model.register_forward_hook(
        lambda _m, _args, kwargs, out: forwards.append((kwargs["input_ids"], out.logits[:, -1].clone())),
        with_kwargs=True)
    prompt = torch.tensor([tok.encode("7:")] * 3)
    config = GenerationConfig(max_new_tokens=5, min_new_tokens=5, do_sample=True, temperature=0.7, top_k=5,
                              top_p=0.9, repetition_penalty=1.3, pad_token_id=tok.pad_token_id,
                              eos_token_id=tok.eos_token_id, return_dict_in_generate=True, output_logits=True)
    try:
        with torch.no_grad():
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
    finally:
        hook.remove()
    new = out.sequences[:, prompt.size(1):]
    assert len(forwards) == len(out.logits) == new.size(1) == 5, (len(forwards), len(out.logits), new.shape)
    for step, ((_, logits), sampled_from) in enumerate(zip(forwards, out.logits, strict=True)):
        assert torch.equal(logits, sampled_from), f"step {step}: generate sampled from other logits than the forward's"
    for step, (input_ids, _) in enumerate(forwards[1:], start=1):
        assert torch.equal(input_ids[:, -1], new[:, step - 1]), f"forward {step} lacks the token sampled before it"


def test_generate_decodes_through_the_compiled_call_compiled_decoding_sets():
    """worker/decoding/compiled.py compiles the model's forward and sets it as the model's _compiled_call with the
    generation's compile_config as _last_compile_config: generate then runs each decoding step through it."""
    from transformers import CompileConfig, GenerationConfig

    tok = build_tokenizer()
    model = build_model(seed=0, tokenizer=tok).eval()
    compile_config = CompileConfig(fullgraph=False, dynamic=False)
    compile_config._compile_all_devices = True  # as the worker sets it on CPU
    steps = []

    def step(*args, **kwargs):
        steps.append(kwargs)
        return model.forward(*args, **kwargs)

    setattr(model, COMPILED_CALL, step)
    setattr(model, LAST_COMPILE_CONFIG, compile_config)
    assert model.get_compiled_call(compile_config) is step
    prompt = torch.tensor([tok.encode("7:")] * 2)
    greedy = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False, "pad_token_id": tok.pad_token_id,
              "eos_token_id": tok.eos_token_id}
    with torch.no_grad():
        compiled = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=(
            GenerationConfig(**greedy, cache_implementation="static", max_cache_len=16, disable_compile=False,
                             compile_config=compile_config)))
        eager = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                               generation_config=GenerationConfig(**greedy, disable_compile=True))
    assert len(steps) == 4, f"{len(steps)} decoding steps went through the compiled call, expected 4 (5 tokens)"
    assert all(kwargs.get("return_dict") is True for kwargs in steps)
    assert torch.equal(compiled, eager)


# Per-token log-probs: the worker's fallback, the PS's proximal log-probs, TRL's loss.

def test_forward_pass_log_probs_are_log_softmax_of_the_logits_at_the_temperature(trainer):
    """What BehaviourCapture computes from generate's logits must be what TRL's forward pass gives: log_softmax of
    the logits divided by args.temperature, at each completion token; returned with entropies and an aux loss."""
    with torch.no_grad():
        batch = getattr(trainer, GENERATE_AND_SCORE)(job_rows(trainer))
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    width = batch["completion_ids"].size(1)
    with torch.no_grad():
        logps, entropies, aux_loss = getattr(trainer, BEHAVIOUR_LOGPS)(trainer.model, ids, mask, width, batch_size=3,
                                                                       compute_entropy=True)
        logits = trainer.model(input_ids=ids, attention_mask=mask).logits[:, -width - 1:-1].float()
    expected = torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(2, batch["completion_ids"][..., None])[..., 0]
    on = batch["completion_mask"].bool()
    torch.testing.assert_close(logps[on], expected[on], atol=1e-5, rtol=1e-5)
    assert entropies.shape == logps.shape == batch["completion_ids"].shape and aux_loss is None


# Checkpoints: ps/trainer.py saves with save_total_limit off and deletes older ones itself, after its ledger.

def test_transformers_deletes_older_checkpoints_while_saving_unless_the_limit_is_off(trainer, tmp_path):
    from transformers.trainer_utils import rotate_checkpoints

    for step in (1, 2):
        (tmp_path / f"checkpoint-{step}").mkdir()
    trainer.create_optimizer_and_scheduler(num_training_steps=10)

    def save_at(step: int, limit: int | None) -> list[str]:
        with replaced(trainer.args, "save_total_limit", limit), replaced(trainer.state, "global_step", step):
            trainer._save_checkpoint(trainer.model, None)
        return sorted(p.name for p in tmp_path.glob("checkpoint-*"))

    with replaced(trainer.args, "output_dir", str(tmp_path)):
        assert trainer._get_output_dir(trial=None) == str(tmp_path)
        assert save_at(3, limit=1) == ["checkpoint-3"]
        assert save_at(4, limit=None) == ["checkpoint-3", "checkpoint-4"]
    rotate_checkpoints(output_dir=str(tmp_path), save_total_limit=1, use_mtime=True, best_model_checkpoint=None)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4"]


# The PS's producer draws its jobs' rows with TRL's RepeatSampler (ps/producer.py).

def test_repeat_sampler_draws_each_prompt_num_generations_times_in_a_row():
    data = list(range(10))
    drawn = list(RepeatSampler(data, mini_repeat_count=4, batch_size=3, repeat_count=1, shuffle=True, seed=5))
    groups = [drawn[i:i + 4] for i in range(0, len(drawn), 4)]
    assert all(len(set(group)) == 1 for group in groups) and len(drawn) % 4 == 0, drawn
    firsts = [group[0] for group in groups]
    assert len(firsts) == 9 and len(set(firsts)) == 9, firsts  # whole batches of 3 distinct prompts per epoch
    assert list(RepeatSampler(data, mini_repeat_count=4, batch_size=3, repeat_count=1, shuffle=True, seed=5)) == drawn
    assert list(RepeatSampler(data, mini_repeat_count=4, batch_size=3, repeat_count=1, shuffle=True, seed=6)) != drawn
    in_order = list(RepeatSampler(data, mini_repeat_count=4, batch_size=3, repeat_count=1, shuffle=False, seed=5))
    assert in_order == [i for i in range(9) for _ in range(4)]


# LoRA (--use_peft): asyncgrpo/peft_args.py copies TRL's ModelConfig flags and hands them to TRL's helpers.

def test_the_peft_flags_are_trl_model_config_s():
    ours = {f.name: f for f in dataclasses.fields(PeftArgs)}
    trls = {f.name: f for f in dataclasses.fields(trl.ModelConfig)}
    for name, field in ours.items():
        assert name in trls, f"trl.ModelConfig no longer has {name} (asyncgrpo/peft_args.py copies it)"
        theirs = trls[name]
        assert (field.default, field.metadata.get("help")) == (theirs.default, theirs.metadata.get("help")), (
            f"trl.ModelConfig.{name} changed: default {theirs.default!r}, help {theirs.metadata.get('help')!r}")
    new = {n for n in trls if n.startswith(("lora_", "use_", "load_in_", "bnb_"))} - set(ours)
    assert not new, f"trl.ModelConfig has new PEFT/quantization flags asyncgrpo does not offer: {sorted(new)}"


@pytest.mark.parametrize("flags", [
    {"use_peft": True, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.1, "lora_target_modules": ["q_proj", "v_proj"],
     "lora_modules_to_save": ["lm_head"], "use_rslora": True},
    {"use_peft": True, "lora_target_parameters": ["mlp.up_proj.weight"], "use_dora": True},
    {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "use_bnb_nested_quant": True},
    {"load_in_8bit": True},
], ids=["lora", "target_parameters", "4bit", "8bit"])
def test_trl_s_peft_helpers_read_only_flags_asyncgrpo_has(flags):
    """asyncgrpo hands TRL's get_peft_config / get_quantization_config its own config for a ModelConfig: called
    with PeftArgs' flags and --dtype alone (a missing one raises AttributeError), they make what the flags say."""
    args = SimpleNamespace(**{f.name: f.default for f in dataclasses.fields(PeftArgs)}, dtype="bfloat16")
    vars(args).update(flags)
    lora, quantization = trl.get_peft_config(args), trl.get_quantization_config(args)
    if args.use_peft:
        assert (lora.r, lora.lora_alpha, lora.lora_dropout, lora.use_rslora, lora.use_dora) == (
            args.lora_r, args.lora_alpha, args.lora_dropout, args.use_rslora, args.use_dora)
        assert lora.target_modules == (set(args.lora_target_modules) if args.lora_target_modules else None)
        assert lora.modules_to_save == args.lora_modules_to_save and lora.task_type == args.lora_task_type
        assert (lora.target_parameters or None) == args.lora_target_parameters
    else:
        assert lora is None
    if args.load_in_4bit:
        assert quantization.load_in_4bit and quantization.bnb_4bit_compute_dtype == torch.bfloat16
        assert (quantization.bnb_4bit_quant_type, quantization.bnb_4bit_use_double_quant) == ("fp4", True)
    else:
        assert (quantization is not None) == args.load_in_8bit and (not quantization or quantization.load_in_8bit)


def test_disable_dropout_in_model_zeroes_every_dropout():
    from trl.trainer.utils import disable_dropout_in_model  # worker/generate.py: sampling without dropout

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.3), torch.nn.Sequential(torch.nn.Dropout()))
    disable_dropout_in_model(model)
    assert [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)] == [0, 0]


def test_a_peft_model_s_reference_is_the_base_with_the_adapter_disabled(tmp_path):
    """--use_peft with --beta > 0: no second model; TRL's reference log-probs are the base model's, the adapter
    disabled (on the PS and on every worker)."""
    cfg = demo_config(tmp_path, per_device_train_batch_size=G * PROMPTS, num_generations=G, beta=0.04, use_peft=True,
                      lora_r=4, lora_dropout=0.0, lora_target_modules="all-linear")
    tok = build_tokenizer()
    peft_trainer = GRPOTrainer(model=build_model(seed=0, tokenizer=tok), reward_funcs=[repeat_digit_reward], args=cfg,
                               train_dataset=build_dataset(n=20, seed=0), processing_class=tok,
                               peft_config=cfg.peft_config())
    assert peft_trainer.ref_model is None, "TRL holds a reference model beside a PEFT model"
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter (a fresh one changes nothing: lora_B starts at 0)
        for name, param in peft_trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    peft_trainer.model.train()
    with torch.no_grad():
        batch = getattr(peft_trainer, GENERATE_AND_SCORE)(job_rows(peft_trainer))
    with peft_trainer.model.disable_adapter():
        base = forward_logps(peft_trainer, batch)
    adapted, on = forward_logps(peft_trainer, batch), batch["completion_mask"].bool()
    assert "ref_per_token_logps" in batch
    torch.testing.assert_close(batch["ref_per_token_logps"][on], base[on])
    assert not torch.allclose(base[on], adapted[on], atol=1e-3), "the adapter changes nothing: the test proves nothing"


def test_the_worker_names_trl_s_internals_only_in_its_seam():
    """worker/trl_seam.py lists every GRPOTrainer internal a worker calls, overrides or reads: each is still in
    TRL's source, and no other worker module names one (as a string, or as an attribute of a trainer)."""
    source = inspect.getsource(inspect.getmodule(GRPOTrainer))
    for name in TRL_INTERNALS:
        assert f"def {name}(" in source or f"self.{name} = " in source, f"GRPOTrainer.{name} is gone"
    internals = {name for name in vars(GRPOTrainer) if name.startswith("_") and not name.startswith("__")}
    internals |= set(re.findall(r"self\.(_[a-z]\w*) = ", source))
    assert set(TRL_INTERNALS) <= internals
    named = []
    for path in sorted((REPO / "worker").rglob("*.py")):
        if path.name == "trl_seam.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in internals:
                named.append(f"{path.name}:{node.lineno} {node.value!r}")
            elif isinstance(node, ast.Attribute) and node.attr in internals and "trainer" in ast.unparse(node.value):
                named.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not named, f"TRL internals named outside worker/trl_seam.py: {named}"
