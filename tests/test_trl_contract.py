"""The TRL internals asyncgrpo relies on (trl 1.16), and the transformers generation loop behaviour log-probs are
captured from. When they change, this fails and names what."""

import inspect
import re

import pytest
import trl
from packaging.version import Version
from transformers import GenerationMixin, Trainer
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler

from worker.generate import BEHAVIOUR_LOGPS, GENERATE, GENERATE_AND_SCORE


def params(func) -> list[str]:
    return list(inspect.signature(func).parameters)


def test_trl_version_is_in_the_pinned_range():
    assert Version("1.16") <= Version(trl.__version__) < Version("1.17"), (
        f"trl {trl.__version__} is outside the range ps/ and worker/ were written against (1.16.x)")


def test_generate_and_score_completions_takes_the_generation_batch():
    method = getattr(GRPOTrainer, GENERATE_AND_SCORE, None)
    assert method is not None, f"GRPOTrainer.{GENERATE_AND_SCORE} is gone (worker and PS override/call it)"
    assert params(method) == ["self", "inputs"], f"GRPOTrainer.{GENERATE_AND_SCORE} signature changed"
    source = inspect.getsource(method)
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


def test_behaviour_logps_helper_signature():
    method = getattr(GRPOTrainer, BEHAVIOUR_LOGPS, None)
    assert method is not None, f"GRPOTrainer.{BEHAVIOUR_LOGPS} is gone (workers compute behaviour log-probs with it)"
    assert params(method)[:6] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size"], (
        f"GRPOTrainer.{BEHAVIOUR_LOGPS} signature changed")


def test_loss_uses_behaviour_logps_for_the_ratio():
    source = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'inputs.get("old_per_token_logps")' in source or 'inputs["old_per_token_logps"]' in source, (
        "GRPOTrainer._compute_loss no longer reads old_per_token_logps: stale samples would not be corrected")


@pytest.mark.parametrize("name", ["_metrics", "_save_checkpoint", "log"])
def test_other_hooks_exist(name):
    if name == "_metrics":
        assert "self._metrics = " in inspect.getsource(GRPOTrainer.__init__), "GRPOTrainer._metrics is gone"
    else:
        assert callable(getattr(GRPOTrainer, name, None)), f"GRPOTrainer.{name} is gone"


def test_repeat_sampler_signature():
    assert params(RepeatSampler.__init__)[1:7] == [
        "data_source", "mini_repeat_count", "batch_size", "repeat_count", "shuffle", "seed"], (
        "trl.trainer.utils.RepeatSampler signature changed (the PS producer draws jobs with it)")


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
