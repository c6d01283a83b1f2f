"""The TRL internals asyncgrpo relies on (trl 1.16). When TRL changes them, this fails and names what."""

import inspect

import pytest
import trl
from packaging.version import Version
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
