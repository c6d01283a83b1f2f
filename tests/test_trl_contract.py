"""The TRL internals asyncgrpo relies on (trl 1.16), and the transformers generation loop behaviour log-probs are
captured from. When they change, this fails and names what.

Each method ps/trainer.py or worker/generate.py overrides or calls is checked with inspect.signature
against the way asyncgrpo calls it (parameter names, order, defaults, **kwargs); the code paths it
depends on inside TRL and transformers are checked in their source."""

import dataclasses
import inspect
import re
import typing

import pytest
import torch
import trl
from packaging.version import Version
from transformers import GenerationMixin, Trainer, TrainerCallback
from transformers.trainer_callback import ProgressCallback, TrainerControl, TrainerState
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler

from asyncgrpo.peft_args import PeftArgs
from worker.decoding import COMPILED_CALL, LAST_COMPILE_CONFIG
from worker.generate import (
    BEHAVIOUR_LOGPS,
    CALCULATE_REWARDS,
    COMPLETION_LOGS,
    GENERATE,
    GENERATE_AND_SCORE,
    GENERATE_SINGLE_TURN,
)

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
                                 ("peft_config", None)], KEYWORDS),
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


def test_per_token_logps_helper_returns_logps_entropies_and_aux_loss():
    annotation = inspect.signature(getattr(GRPOTrainer, BEHAVIOUR_LOGPS), eval_str=True).return_annotation
    assert typing.get_origin(annotation) is tuple and len(typing.get_args(annotation)) == 3, (
        f"GRPOTrainer.{BEHAVIOUR_LOGPS} returns {annotation}: the PS and the worker unpack (logps, entropies, "
        "aux_loss)")


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
        "TrainerControl.should_save is gone (the PS moves a save that falls inside a job to its last step)")
    assert "self.training_bar = " in inspect.getsource(ProgressCallback), (
        "ProgressCallback.training_bar is gone (the PS shows reward and staleness on it)")


def test_trl_version_is_in_the_pinned_range():
    assert Version("1.16") <= Version(trl.__version__) < Version("1.17"), (
        f"trl {trl.__version__} is outside the range ps/ and worker/ were written against (1.16.x)")


def test_generate_and_score_completions_returns_the_keys_the_ps_trains_on():
    source = inspect.getsource(getattr(GRPOTrainer, GENERATE_AND_SCORE))
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                "num_items_in_batch", "old_per_token_logps"):
        assert f'"{key}"' in source, f"GRPOTrainer.{GENERATE_AND_SCORE} no longer returns {key!r}"


def test_prepare_inputs_generates_through_the_overridden_method():
    source = inspect.getsource(GRPOTrainer._prepare_inputs)
    assert f"self.{GENERATE_AND_SCORE}(" in source, (
        f"GRPOTrainer._prepare_inputs no longer calls {GENERATE_AND_SCORE}: the PS override would be bypassed")


def test_generation_is_one_call_inside_generate_and_score():
    source = inspect.getsource(getattr(GRPOTrainer, GENERATE_AND_SCORE))
    assert f"self.{GENERATE}(" in source, (
        f"GRPOTrainer.{GENERATE_AND_SCORE} no longer calls {GENERATE}: workers time generation and scoring by it")


def test_loss_uses_behaviour_logps_for_the_ratio():
    source = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'inputs.get("old_per_token_logps")' in source or 'inputs["old_per_token_logps"]' in source, (
        "GRPOTrainer._compute_loss no longer reads old_per_token_logps: stale samples would not be corrected")


def test_evaluation_generates_through_the_overridden_method():
    source = inspect.getsource(GRPOTrainer.prediction_step)
    assert "self._prepare_inputs(inputs)" in source, (
        "GRPOTrainer.prediction_step no longer prepares (generates) its inputs: the PS's evaluation (--eval_strategy) "
        f"relies on it reaching {GENERATE_AND_SCORE} in eval mode")


def test_reference_model_is_built_from_model_init_kwargs():
    source = inspect.getsource(GRPOTrainer.__init__)
    assert "model_init_kwargs = dict(args.model_init_kwargs or {})" in source and (
        "self.ref_model = create_model_from_path(get_config_model_id(self.model.config), **model_init_kwargs)"
        in source), ("GRPOTrainer no longer builds its reference model from args.model_init_kwargs: asyncgrpo sets "
                     "them to how it loaded the policy (asyncgrpo/inputs.py load_model_and_tokenizer)")
    assert "`model_init_kwargs` will be ignored" in source, (
        "GRPOTrainer's warning that model_init_kwargs are ignored for a loaded model changed: asyncgrpo filters it "
        "(it applied them) by this text (asyncgrpo/inputs.py _ModelInitKwargsApplied)")


def test_metrics_dict_the_worker_and_ps_read():
    assert "self._metrics = " in inspect.getsource(GRPOTrainer.__init__), "GRPOTrainer._metrics is gone"


# Behaviour log-probs captured during generation (worker.generate.BehaviourCapture).

def test_transformers_path_is_one_generate_call_on_the_unwrapped_model():
    source = inspect.getsource(GRPOTrainer._generate_single_turn)
    assert source.count("unwrapped_model.generate(") == 1, (
        "GRPOTrainer._generate_single_turn no longer calls unwrapped_model.generate once: workers capture behaviour "
        "log-probs from that call")
    assert re.search(r"unwrap_model_for_generation\(\s*self\.model_wrapped,", source), (
        "GRPOTrainer._generate_single_turn no longer generates with unwrap_model_for_generation(self.model_wrapped): "
        "workers watch accelerator.unwrap_model(trainer.model_wrapped)")
    assert "self.model_wrapped = " in inspect.getsource(Trainer.__init__), "Trainer.model_wrapped is gone"
    assert 'prompt_length = generate_inputs["input_ids"].size(1)' in source and (
        "completion_ids = prompt_completion_ids[:, prompt_length:]" in source), (
        "GRPOTrainer._generate_single_turn no longer takes completions as generate's output after the padded prompt")
    assert "self._generate_single_turn(" in inspect.getsource(getattr(GRPOTrainer, GENERATE))


def test_generate_and_score_keeps_the_generated_row_order():
    source = inspect.getsource(getattr(GRPOTrainer, GENERATE_AND_SCORE))
    for word in ("shuffle", "randperm", "argsort"):
        assert word not in source, (
            f"GRPOTrainer.{GENERATE_AND_SCORE} may reorder rows ({word}): captured behaviour log-probs follow "
            "generate's row order (the worker would notice and fall back to a forward pass on every job)")


@pytest.mark.parametrize("attribute", ["use_vllm", "use_transformers_continuous_batching", "rollout_func", "tools",
                                       "generation_config", "temperature"])
def test_generation_settings_capture_reads(attribute):
    assert f"self.{attribute} = " in inspect.getsource(GRPOTrainer.__init__), (
        f"GRPOTrainer.{attribute} is gone (workers read it to decide whether behaviour log-probs can be captured)")


def test_forward_pass_log_probs_are_at_the_configured_temperature():
    source = inspect.getsource(GRPOTrainer.__init__)
    assert "self.temperature = args.temperature" in source and "temperature=self.temperature," in source, (
        "GRPOTrainer's fused LM head no longer divides by args.temperature: captured behaviour log-probs would "
        "not match TRL's")


def test_transformers_sampling_loop_samples_from_the_raw_last_logits():
    source = inspect.getsource(GenerationMixin._sample)
    assert "next_token_logits = outputs.logits[:, -1]" in source and (
        "logits_processor(input_ids, next_token_logits)" in source), (
        "transformers' _sample no longer samples from the model's last-position logits: the forward hook workers "
        "capture behaviour log-probs with may no longer see them")
    assert "input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)" in source, (
        "transformers' _sample no longer appends one sampled token per forward")


def test_transformers_deletes_older_checkpoints_as_ps_trainer_expects():
    source = inspect.getsource(Trainer._save_checkpoint)
    assert "rotate_checkpoints(" in source and "save_total_limit=self.args.save_total_limit" in source, (
        "transformers' _save_checkpoint no longer deletes older checkpoints by args.save_total_limit: ps/trainer.py "
        "turns that off while it saves and deletes them itself once the new checkpoint's ledger is written")


def test_trl_generates_a_jobs_prompts_as_generate_jobs_does():
    source = inspect.getsource(getattr(GRPOTrainer, GENERATE))
    assert "prompt_ids, images, multimodal_fields = self._tokenize_prompts(prompts)" in source and (
        "completion_ids, logprobs = self._generate_single_turn(" in source), (
        "GRPOTrainer._generate no longer tokenizes with _tokenize_prompts and generates with _generate_single_turn: "
        "worker/generate.py generate_jobs does both for several jobs at once")
    assert "return completion_ids, logprobs" in inspect.getsource(getattr(GRPOTrainer, GENERATE_SINGLE_TURN))
    assert "disable_compile=True" in inspect.getsource(GRPOTrainer.__init__), (
        "GRPOTrainer no longer turns compilation off in its generation config: see worker/decoding.py")


def test_generate_takes_the_compiled_call_compiled_decoding_sets():
    from transformers import PreTrainedModel

    source = inspect.getsource(PreTrainedModel.get_compiled_call)
    assert f"not hasattr(self, \"{COMPILED_CALL}\")" in source and (
        f"getattr(self, \"{LAST_COMPILE_CONFIG}\", default_config) != compile_config" in source) and (
        f"return self.{COMPILED_CALL}" in source), (
        "transformers' get_compiled_call no longer returns the model's _compiled_call when _last_compile_config is "
        "the generation's compile_config: worker/decoding.py sets both to compile forward, not __call__")
    sample = inspect.getsource(GenerationMixin._sample)
    assert "self.get_compiled_call(generation_config.compile_config)" in sample and (
        "model_forward(**model_inputs, return_dict=True)" in sample), (
        "transformers' _sample no longer decodes through get_compiled_call: compiled decoding would not run")


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


@pytest.mark.parametrize("helper", [trl.get_peft_config, trl.get_quantization_config], ids=lambda f: f.__name__)
def test_trl_s_peft_helpers_read_only_flags_asyncgrpo_has(helper):
    read = set(re.findall(r"model_args\.(\w+)", inspect.getsource(helper)))
    missing = read - {f.name for f in dataclasses.fields(PeftArgs)} - {"dtype"}  # dtype: ModelArguments' --dtype
    assert not missing, f"trl.{helper.__name__} now reads {sorted(missing)}, which asyncgrpo/peft_args.py lacks"


def test_disable_dropout_in_model_zeroes_every_dropout():
    from trl.trainer.utils import disable_dropout_in_model  # worker/generate.py: sampling without dropout

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.3), torch.nn.Sequential(torch.nn.Dropout()))
    disable_dropout_in_model(model)
    assert [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)] == [0, 0]


def test_a_peft_model_s_reference_is_the_base_with_the_adapter_disabled():
    init, score = inspect.getsource(GRPOTrainer.__init__), inspect.getsource(getattr(GRPOTrainer, GENERATE_AND_SCORE))
    assert re.search(r"elif is_peft_model\(model\):\s*(#.*\s*)*self\.ref_model = None", init), (
        "GRPOTrainer no longer skips the reference model for a PEFT model: with --use_peft and beta > 0 every "
        "process would hold a second copy of the model")
    assert 'use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None)' in score, (
        "GRPOTrainer no longer computes a PEFT model's reference log-probs with the adapter disabled")


# A failing job names its reward function (worker.generate.error_record); completions-table rows travel with results.

def test_the_reward_loop_holds_the_name_of_the_function_it_calls():
    source = inspect.getsource(inspect.unwrap(getattr(GRPOTrainer, CALCULATE_REWARDS)))
    assert "for i, (reward_func, reward_processing_class, reward_func_name) in enumerate(" in source, (
        f"GRPOTrainer.{CALCULATE_REWARDS} no longer loops with reward_func_name: a failed job's error would not "
        "name the reward function that raised")
    assert "async def _invoke_async(index, func, func_name):" in source, (
        f"GRPOTrainer.{CALCULATE_REWARDS}'s async path no longer calls _invoke_async(index, func, func_name)")
    assert "returned {len(output_reward_func)} rewards" in source, (
        "TRL no longer checks the number of rewards a reward function returns")


def test_the_completions_table_is_filled_while_scoring_and_printed_by_log():
    init = inspect.getsource(GRPOTrainer.__init__)
    assert f"self.{COMPLETION_LOGS} = {{" in init, f"GRPOTrainer.{COMPLETION_LOGS} (the completions table) is gone"
    for key in ("images", "prompt", "completion", "rewards", "advantages", "extra"):
        assert f'"{key}": ' in init, f"GRPOTrainer.{COMPLETION_LOGS} has no {key!r} column"
    scoring = inspect.getsource(getattr(GRPOTrainer, GENERATE_AND_SCORE))
    for fill in ('["prompt"].extend(', '["completion"].extend(', '["rewards"][name].extend(',
                 '["advantages"].extend(', '["extra"][column].extend('):
        assert f"self.{COMPLETION_LOGS}{fill}" in scoring, (
            f"GRPOTrainer.{GENERATE_AND_SCORE} no longer fills self.{COMPLETION_LOGS}{fill}...): workers send, and the "
            "PS fills, the completions table the same way")
    log = inspect.getsource(GRPOTrainer.log)
    assert "if self.accelerator.is_main_process and self.log_completions:" in log and (
        f'self.{COMPLETION_LOGS}["prompt"]' in log), (
        f"GRPOTrainer.log no longer prints the completions table from self.{COMPLETION_LOGS}")
