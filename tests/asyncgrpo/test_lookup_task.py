"""The built-in lookup task (asyncgrpo.tasks.lookup): tokenizer and TRL's tool-calling checks, environment, reward
and TRL's wiring."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

from asyncgrpo.tasks.lookup import (
    CALL_TOKENS,
    LOOKUP_DEFAULTS,
    NO_SUCH_KEY,
    LookupEnv,
    build_dataset,
    build_model,
    build_tokenizer,
    cpu_overrides,
    lookup_reward,
    write_lookup_model,
)

LOOKUP_3 = [{"type": "function", "function": {"name": "lookup", "arguments": {"key": 3}}}]


def _prompt_ids(tok, key=3):
    return tok.apply_chat_template(
        [{"role": "user", "content": f"key {key}?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def _assistant(content="", tool_calls=None):
    return {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}


def test_trl_accepts_the_chat_template_for_tool_calling():
    tok = build_tokenizer()
    assert supports_tool_calling(tok)
    assert is_chat_template_prefix_preserving(tok)


def test_a_whole_rollout_renders_as_the_documented_tokens():
    tok = build_tokenizer()
    messages = [
        {"role": "user", "content": "key 3?"},
        _assistant(tool_calls=LOOKUP_3),
        {"role": "tool", "name": "lookup", "content": "7"},
        _assistant("7"),
    ]
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert tok.convert_ids_to_tokens(ids) == ["<user>", "k", "e", "y", " ", "3", "?", "<assistant>", CALL_TOKENS[3],
                                              "<tool>", "7", "<assistant>", "7", "<eos>"]


def test_parse_response_turns_a_call_token_into_a_lookup_call():
    tok = build_tokenizer()
    call_ids = tok.encode(CALL_TOKENS[3], add_special_tokens=False)
    assert len(call_ids) == 1
    parsed = parse_response(tok, call_ids, prefix=_prompt_ids(tok))
    assert parsed["tool_calls"] == LOOKUP_3
    assert parse_response(tok, tok.encode("7<eos>", add_special_tokens=False), prefix=_prompt_ids(tok)) == {
        "role": "assistant",
        "content": "7",
    }


def test_a_saved_and_reloaded_tokenizer_still_parses_calls(tmp_path):
    path = write_lookup_model(tmp_path / "lookup", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.response_template is not None and supports_tool_calling(tok)
    call_ids = tok.encode(CALL_TOKENS[3], add_special_tokens=False)
    assert parse_response(tok, call_ids, prefix=_prompt_ids(tok))["tool_calls"] == LOOKUP_3
    # The call tokens end a turn in the saved model too, so generation stops at a call.
    model = AutoModelForCausalLM.from_pretrained(path)
    assert set(tok.convert_tokens_to_ids(list(CALL_TOKENS))) <= set(model.generation_config.eos_token_id)


def test_the_env_returns_the_rows_secret_for_its_key_only():
    env = LookupEnv()
    assert env.reset(prompt=[{"role": "user", "content": "key 3?"}], key=3, secret=7) is None
    assert env.lookup(key=3) == "7"
    assert env.lookup(key=4) == NO_SUCH_KEY
    assert env.calls == [3, 4]
    env.reset(key=4, secret=1)
    assert env.calls == [] and env.lookup(4) == "1"


def test_the_reward_scores_right_and_wrong_answers():
    def env(key, calls):
        e = LookupEnv()
        e.reset(key=key, secret=7)
        for k in calls:
            e.lookup(k)
        return e

    tool = {"role": "tool", "name": "lookup", "content": "7"}
    cases = [  # (completion, env) -> reward
        ([_assistant(tool_calls=LOOKUP_3), tool, _assistant("7")], env(3, [3]), 1.0),
        ([_assistant("7")], env(3, []), 1.0),  # a lucky guess is still the right answer
        ([_assistant(tool_calls=LOOKUP_3), tool, _assistant("77")], env(3, [3]), 0.5),
        ([_assistant(tool_calls=LOOKUP_3), tool, _assistant("5")], env(3, [3]), 0.2),
        ([_assistant(tool_calls=LOOKUP_3), tool], env(3, [3]), 0.2),  # ended on the tool's answer: not an answer
        ([_assistant("5")], env(3, []), 0.0),
        ([_assistant("77")], env(3, []), 0.0),  # partial credit only after the right call
        ([_assistant(tool_calls=LOOKUP_3), tool, _assistant("5")], env(4, [3]), 0.0),  # wrong key
    ]
    completions, envs, expected = zip(*cases, strict=True)
    assert lookup_reward(list(completions), environments=list(envs), secret=[7] * len(cases)) == list(expected)


def test_the_dataset_has_keys_and_random_secrets():
    ds = build_dataset(n=100, seed=0)
    assert ds[0]["prompt"] == [{"role": "user", "content": f"key {ds[0]['key']}?"}]
    assert sorted(set(ds["key"])) == list(range(10)) and set(ds["secret"]) <= set(range(10))
    assert len(set(zip(ds["key"], ds["secret"], strict=True))) > 50  # the secret does not follow from the key
    assert build_dataset(n=100, seed=0)["secret"] == ds["secret"] != build_dataset(n=100, seed=1)["secret"]


class _Logs(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.logs.append(dict(logs))


@pytest.mark.filterwarnings("ignore")
def test_grpo_trainer_runs_the_tool_loop_with_lookup_env(tmp_path):
    """Two real GRPO steps. A random model's first token is one of the 10 call tokens (of 32) about a third of
    the time, so among 16 rollouts a step some call the tool: TRL's tool loop then runs, masks the tool's tokens
    out of the loss (tool_mask 0) and logs tools/call_frequency."""
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(**{**LOOKUP_DEFAULTS, **cpu_overrides(), "output_dir": str(tmp_path / "out"), "seed": 0,
                         "max_steps": 2, "per_device_train_batch_size": 16, "disable_tqdm": True})
    tok, logs = build_tokenizer(), _Logs()
    trainer = GRPOTrainer(model=build_model(seed=0, tokenizer=tok), reward_funcs=[lookup_reward], args=args,
                          train_dataset=build_dataset(n=64, seed=0), processing_class=tok,
                          environment_factory=LookupEnv, callbacks=[logs])
    tool_masks = []
    generate = trainer._generate

    def recording_generate(prompts):
        out = generate(prompts)
        tool_masks.extend(out[2])  # (prompt_ids, completion_ids, tool_mask, ...)
        return out

    trainer._generate = recording_generate
    trainer.train()

    assert len(logs.logs) == 2
    assert all("tools/call_frequency" in log for log in logs.logs)
    assert sum(log["tools/call_frequency"] for log in logs.logs) > 0
    # A rollout that called: its first turn, ending at the call token (1s), the tool's suffix (three 0s: <tool>,
    # result, <assistant>), then the answer (1s). At most one call (max_tool_calling_iterations=1).
    called = [mask for mask in tool_masks if 0 in mask]
    assert called
    for mask in called:
        first = mask.index(0)
        assert first >= 1 and mask[first : first + 3] == [0, 0, 0] and 0 not in mask[first + 3 :]
