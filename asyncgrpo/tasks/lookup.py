"""The built-in tool-calling task ("lookup"): answer with the secret digit stored under a key, which only a tool knows.

Each dataset row is a one-message conversation, "key K?" (K a digit), with two extra columns: `key` (K) and
`secret` (a digit drawn at random per row, seeded), so the key -> secret mapping cannot be memorised. TRL's
`GRPOTrainer(environment_factory=LookupEnv)` makes one `LookupEnv` per rollout and exposes its `lookup(key)`
method as a tool: it returns the row's secret for the row's key, else "no such key". The model must call
`lookup` with the key copied from the prompt, read the tool's answer, and answer with that digit.

Everything is offline and tiny, like the demo task: a tokenizer made with the `tokenizers` library in which
a whole tool call is ONE token (one per key: `<tool_call>{"name": "lookup", "arguments": {"key": 3}}</tool_call>`),
and a tiny Llama. One whole rollout (prompt, then completion; `|` marks TRL's turns):

    <user> k e y ␣ 3 ? <assistant> | CALL_3 | <tool> 7 <assistant> | 7 <eos>

Why a call is one token and ends the turn: we first tried the call as open-token, key digit, close-token,
then <eos>. A random policy never writes that by chance, and any credit for a well-formed call (whatever its
key) made the policy settle on one key for every prompt, after which no GRPO group has reward variance and it
never learns to copy the key (seen with credit per call-token and with credit from the environment, 64 and
128 hidden). With one token per key, the right call is a 1-in-33 first token, like the demo's first_digit task.
The call tokens are also end-of-turn ids (`generation_config.eos_token_id`), so a turn holds one call and stops
there; the chat template matches: a tool-calling assistant turn has no <eos>, and no turn but the final
answer ends with <eos> (TRL's `_get_tool_suffix_ids` cuts its prefix at the last <eos>, so an <eos> closing
the user turn and none closing the call would break it).

The tokenizer carries its chat template and a `response_template` (transformers >= 5.13), so TRL's
`parse_response` turns a generated call token into `tool_calls`; both survive `save_pretrained` /
`AutoTokenizer.from_pretrained` (see `write_lookup_model`).

`lookup_reward` is 1.0 for a final answer that is exactly the secret (a lucky guess without the tool counts
too: 1 in 10 for a digit). Partial credit goes only to progress along the right path (see the function), never
to a well-formed but wrong call (that is what made the policy collapse above).

`LOOKUP_DEFAULTS` holds the best GRPOConfig keyword arguments found so far; calibrated with plain TRL 1.16 on
a 2-core CPU VM by bench/trl_baseline.py --task lookup (add `cpu_overrides()` on CPU). NOT YET AT THE TARGET:
with these defaults, seeds 0/1/2, the rolling-10 reward goes from ~0.03 to 0.2 (every rollout makes the
right call, tools/call_frequency 1.0) by step ~150, reaches 0.5 at steps 469/457/473, then hovers at
0.45-0.6 until max_steps 1000 (final rolling 0.45/0.61/0.57); 0.8 was not reached. Likely (not verified)
the answer learns to start with the secret (0.5) more readily than to stop right after it (1.0). A step
costs ~260 ms alone (seed 2: mean 262, median 243), 320-450 ms with a second run on the 2 cores. With a
32-rollout batch, seed 0 reached 0.55 at step 900. Also tried, with the earlier "key K" prompt: lr 2e-3
and 3e-3 (unstable), hidden 256 (slower, no better).

Under asyncgrpo the same defaults seemed to learn further (0.8 at step 290 synchronous, seed 0); with more
seeds, both trainers reach 0.8 on two seeds of three when each batch's sampling is seeded as a worker seeds a
job, and level off on the third: the difference is the sample stream, not the training (docs/performance.md,
"The lookup task against TRL").
"""

from __future__ import annotations

import os
import random
from typing import Any

from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from asyncgrpo.tasks import demo, tiny_llama
from asyncgrpo.tasks.demo import cpu_overrides  # noqa: F401  (re-exported: the same CPU overrides apply)
from asyncgrpo.tasks.tiny_llama import BOS, EOS, PAD, UNK

USER, ASSISTANT, TOOL = "<user>", "<assistant>", "<tool>"
DIGITS = "0123456789"
# One token per possible call, spelled exactly as the chat template renders a lookup call with that key.
CALL_TOKENS = tuple(f'<tool_call>{{"name": "lookup", "arguments": {{"key": {d}}}}}</tool_call>' for d in DIGITS)
NO_SUCH_KEY = "no such key"  # one token too, so a wrong call's result is as short as a right one's
CHARS = tuple(DIGITS) + tuple("key ?")  # everything else is one token per character
MAX_POSITIONS = demo.MAX_POSITIONS  # the model's context, the demo's

# The "?" after the key matters: with "key K" the call (K, <assistant> -> CALL_K) and the answer (S, <assistant>
# -> S) read a digit at the same offset, and the learned call circuit kept answering with calls; with "key K?"
# the answer's reward climbed in a few hundred steps instead of staying flat. Roles are marked by single tokens.
# Only a final answer ends with <eos>: a tool-calling turn ends at its call
# (the call tokens are end-of-turn ids), the user and tool turns at the next role token. Tool schemas are not
# rendered (the model learns the one tool from the reward), keeping prompts at 8 tokens.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<user>{{ m.content }}"
    "{%- elif m.role == 'tool' -%}<tool>{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<assistant>{{ m.content }}"
    "{%- for call in m.tool_calls or [] -%}"
    '<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>'
    "{%- endfor -%}"
    "{%- if not m.tool_calls -%}<eos>{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<assistant>{%- endif -%}"
)

# transformers' new-style response parser (what TRL's parse_response uses): the text after the last <assistant>
# is the message; each <tool_call>...</tool_call> holds a JSON call; the rest, up to <eos>, is the content.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": ASSISTANT,
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close": EOS, "content": "text"},
    },
}

# GRPOConfig keyword arguments (bench/trl_baseline.py --task lookup; see the module docstring); on CPU add
# cpu_overrides().
LOOKUP_DEFAULTS: dict[str, Any] = {
    "learning_rate": 1e-3,
    # Linear decay to 0 at max_steps, as in DEMO_DEFAULTS (keeps a learned policy from drifting off).
    "lr_scheduler_type": "linear",
    "max_steps": 1000,
    # 64 rollouts per step = 8 prompts x 8 generations: with 32, seed 0 reached the same reward in ~1.9x the
    # steps (about the same wall time).
    "per_device_train_batch_size": 64,
    "num_generations": 8,
    # call (1) + tool result (3: <tool>, digit, <assistant>) + answer and <eos> (2) = 6; 2 tokens of slack.
    "max_completion_length": 8,
    # One call, then the answer: a second call is never needed.
    "max_tool_calling_iterations": 1,
    "temperature": 1.0,
    "beta": 0.0,  # no KL term, no reference model
    "logging_steps": 1,
    "gradient_checkpointing": False,  # slower on a model this small, same result
    "report_to": "none",
    "save_strategy": "no",
}


class LookupEnv:
    """One rollout's environment (TRL's `environment_factory` contract): `reset(**row)`, then the `lookup` tool."""

    def __init__(self):
        self.key: int | None = None
        self.secret: int | None = None
        self.calls: list = []  # the keys `lookup` was called with, in order (read by lookup_reward)

    def reset(self, key: int, secret: int, **row) -> None:
        """Start a rollout for a dataset row; TRL passes every column (`prompt` too) as a keyword argument."""
        self.key, self.secret, self.calls = int(key), int(secret), []

    def lookup(self, key: int) -> str:
        """Look up the secret digit stored under a key.

        Args:
            key: The key to look up, a digit.

        Returns:
            The secret digit stored under the key, or "no such key".
        """
        self.calls.append(key)
        return str(self.secret) if key == self.key else NO_SUCH_KEY


def lookup_reward(completions, environments=None, secret=None, **kwargs) -> list[float]:
    """1.0 when the final assistant message is exactly the row's secret digit; partial credit on the right path.

    TRL's reward signature: `secret` is the dataset column, `environments` the rollouts' LookupEnv instances.
    Partial credit, only when the first call used the row's key (credit for a wrong call made the policy collapse
    onto one key): 0.5 when the answer starts with the secret but does not stop there, else 0.2. A final message
    that is a tool call or a tool result (the tool loop can end on one) counts as no answer.
    """
    rewards = []
    for i, completion in enumerate(completions):
        final = completion[-1] if completion else {}
        answer = final.get("content") or "" if final.get("role") == "assistant" else ""
        right_call = environments is not None and environments[i].calls[:1] == [environments[i].key]
        if answer == str(secret[i]):
            rewards.append(1.0)
        elif right_call and answer[:1] == str(secret[i]):
            rewards.append(0.5)
        elif right_call:
            rewards.append(0.2)
        else:
            rewards.append(0.0)
    return rewards


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The lookup tokenizer (33 tokens), with its chat template and response template set.

    Role tokens and <eos> are special; the call tokens and "no such key" are plain added tokens (matched whole
    before the per-character split), so decoding keeps them and the response parser sees the call's JSON.
    """
    specials = (PAD, BOS, EOS, UNK, USER, ASSISTANT, TOOL)
    words = (*CALL_TOKENS, NO_SUCH_KEY)
    return tiny_llama.character_tokenizer(
        specials + words + CHARS, special=specials, whole=words, additional_special_tokens=[USER, ASSISTANT, TOOL],
        # TRL's template checks tokenise a few dozen characters of probe text; this silences a length warning.
        model_max_length=4 * MAX_POSITIONS, chat_template=CHAT_TEMPLATE, response_template=RESPONSE_TEMPLATE)


# 128 hidden rather than the demo's 64: the task needs copying a digit twice (prompt key -> call, tool result ->
# answer), which a 64-wide model learns several times slower (also supervised: ~270 vs ~70 steps).
MODEL_SHAPE = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "intermediate_size": 256}  # about 0.3M parameters


def build_model(seed: int = 0, tokenizer: PreTrainedTokenizerFast | None = None, **shape) -> LlamaForCausalLM:
    """A tiny Llama of MODEL_SHAPE (``shape``: sizes that differ) whose turns end at <eos> or at a call token."""
    tok = tokenizer if tokenizer is not None else build_tokenizer()
    model = tiny_llama.build_model(tok, seed, **{**MODEL_SHAPE, **shape}, max_positions=MAX_POSITIONS)
    # TRL stops a completion at any of these ids and runs the tool loop on it; saved in generation_config.json.
    model.generation_config.eos_token_id = [tok.eos_token_id, *tok.convert_tokens_to_ids(list(CALL_TOKENS))]
    return model


def write_lookup_model(path: str | os.PathLike, seed: int = 0, **model_kwargs) -> str:
    """Save `build_model(seed, **model_kwargs)` and `build_tokenizer()` to folder `path`; return it.

    `AutoTokenizer.from_pretrained(path)` gets the chat template and the response template back (no extra step).
    """
    tok = build_tokenizer()
    return tiny_llama.save(path, build_model(seed=seed, tokenizer=tok, **model_kwargs), tok)


def user_prompt(key: int) -> str:
    """The user message of a row: "key K?" (the "?" is part of the task, see CHAT_TEMPLATE's comment)."""
    return f"key {key}?"


def build_dataset(n: int = 1000, seed: int = 0):
    """A `datasets.Dataset` of `n` rows: "prompt" ([user "key K?"]), "key" (K, balanced over digits), "secret"."""
    from datasets import Dataset

    rng = random.Random(seed)
    keys = [i % 10 for i in range(n)]
    rng.shuffle(keys)
    secrets = [rng.randrange(10) for _ in range(n)]
    prompts = [[{"role": "user", "content": user_prompt(k)}] for k in keys]
    return Dataset.from_dict({"prompt": prompts, "key": keys, "secret": secrets})
