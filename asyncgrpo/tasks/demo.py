"""The built-in tasks: prompts "0:" .. "9:", and two rewards (--builtin_task).

* ``repeat`` (the demo): repeat the digit N. The reward of a completion is the fraction of its characters
  equal to N (an empty completion scores 0.0). A random policy scores about 1/16 (the vocabulary has 16
  tokens); a trained one scores 1.0.
* ``first_digit``: answer with the digit N. The reward is binary: 1.0 when the completion starts with N,
  else 0.0; completions end where the model emits EOS (or at max_completion_length), so their lengths vary.
  A random policy succeeds on about 1/16 of its samples, so most groups of 8 are all wrong early (zero
  advantage) and all right once learned: the task dynamic sampling is for.

Everything is built in-process, offline (asyncgrpo/tasks/tiny_llama.py): a character-level tokenizer (one token
per character) and a tiny Llama. `write_demo_model` saves both so that `AutoModelForCausalLM.from_pretrained` /
`AutoTokenizer.from_pretrained` load them back.

`DEMO_DEFAULTS` holds the `GRPOConfig` keyword arguments that learn the task; calibrated against plain
TRL 1.16 on 2 CPU cores by bench/trl_baseline.py --task demo. On CPU the caller also passes `use_cpu=True`
and `bf16=False` (GRPOConfig turns bf16 on by default and fails without a GPU); see `cpu_overrides()`.
"""

from __future__ import annotations

import os
import random
from typing import Any

from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from asyncgrpo.tasks import tiny_llama
from asyncgrpo.tasks.tiny_llama import BOS, EOS, PAD, UNK

SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARS = tuple("0123456789:") + (" ",)
DIGITS = "0123456789"
MAX_POSITIONS = 64

# GRPOConfig keyword arguments that learn the demo task (see bench/trl_baseline.py --task demo for the calibration).
# Device handling is the caller's job: on CPU add cpu_overrides() (use_cpu=True, bf16=False).
# Plain TRL 1.16 on CPU with these, seeds 0-9: rolling-10 reward >= 0.9 after 190-225 steps, >= 0.99 after
# 300-365, and it stays there (~45-55 ms a step on 2 cores).
DEMO_DEFAULTS: dict[str, Any] = {
    # TRL's default (1e-6) learns nothing on a tiny model in any reasonable number of steps.
    "learning_rate": 1e-3,
    # Linear decay to 0 at max_steps (the Trainer's default, spelled out). With a constant lr (1e-3, 7e-4,
    # even 5e-4 over 2000 steps) some seeds reach ~1.0, then lose a whole digit later: the policy is so sharp
    # that all 8 completions for that prompt are the same wrong digit, the group's reward std is 0, so GRPO
    # gets no signal to recover (the rolling reward sits at ~0.75-0.9 for hundreds of steps). The decay
    # prevented that in every seed tried, with max_steps 1000 and 2000. Keep max_steps (it sets the decay);
    # stop early with a callback rather than shortening it, or the lr falls too soon.
    "lr_scheduler_type": "linear",
    "max_steps": 1000,
    # 32 completions per step = 4 prompts x 8 generations.
    "per_device_train_batch_size": 32,
    "num_generations": 8,
    # 8 characters: a graded reward (eighths) at a low cost; 4 learns in about as many steps (~20% cheaper
    # steps), 16 needs ~15% more steps and costs more per step.
    "max_completion_length": 8,
    "temperature": 1.0,
    # No KL term: no reference model to hold or run.
    "beta": 0.0,
    "logging_steps": 1,
    # GRPOConfig turns gradient checkpointing on by default; on this model it makes a step ~60% slower, same result.
    "gradient_checkpointing": False,
    "report_to": "none",
    "save_strategy": "no",
}


def cpu_overrides() -> dict[str, Any]:
    """The GRPOConfig keyword arguments needed on a machine without a GPU (TRL 1.16 defaults bf16 to True)."""
    return {"use_cpu": True, "bf16": False}


def repeat_digit_reward(prompts, completions, **kwargs) -> list[float]:
    """Fraction of each completion's characters equal to the prompt's digit N ("N:"); empty completion: 0.0.

    TRL's reward-function signature; completions are plain strings for this (non-conversational) dataset.
    A conversational completion (a list of messages) is scored on its last message's content.
    """
    rewards = []
    for prompt, completion in zip(prompts, completions, strict=True):
        digit = _prompt_digit(prompt)
        text = _as_text(completion)
        rewards.append(sum(ch == digit for ch in text) / len(text) if text else 0.0)
    return rewards


def first_digit_reward(prompts, completions, **kwargs) -> list[float]:
    """1.0 for a completion that starts with the prompt's digit N ("N:"), else 0.0 (TRL's signature)."""
    return [float(_as_text(c).startswith(_prompt_digit(p) or "-")) for p, c in zip(prompts, completions, strict=True)]


def _as_text(x) -> str:
    if isinstance(x, str):
        return x
    if isinstance(x, list) and x and isinstance(x[-1], dict):
        return str(x[-1].get("content", ""))
    return str(x)


def _prompt_digit(prompt) -> str:
    text = _as_text(prompt).strip()
    head = text.split(":", 1)[0]
    return head[-1] if head else ""


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character of "0123456789: ", plus <pad>/<bos>/<eos>/<unk>.

    No special tokens are added on encoding ("7:" -> 2 ids), decoding joins characters without spaces,
    padding is on the left (as TRL pads prompts).
    """
    return tiny_llama.character_tokenizer(SPECIAL_TOKENS + CHARS, model_max_length=MAX_POSITIONS)


MODEL_SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 96}  # about 71k parameters


def build_model(seed: int = 0, tokenizer: PreTrainedTokenizerFast | None = None, **shape) -> LlamaForCausalLM:
    """A tiny Llama of MODEL_SHAPE (``shape``: sizes that differ) over the demo tokenizer, deterministic given
    `seed`."""
    tok = tokenizer if tokenizer is not None else build_tokenizer()
    return tiny_llama.build_model(tok, seed, **{**MODEL_SHAPE, **shape}, max_positions=MAX_POSITIONS)


def write_demo_model(path: str | os.PathLike, seed: int = 0, **model_kwargs) -> str:
    """Save `build_model(seed, **model_kwargs)` (safetensors) and `build_tokenizer()` to folder `path`; return it."""
    tok = build_tokenizer()
    return tiny_llama.save(path, build_model(seed=seed, tokenizer=tok, **model_kwargs), tok)


def build_dataset(n: int = 1000, seed: int = 0):
    """A `datasets.Dataset` of `n` rows: "prompt" ("N:") and "digit" (N, int), balanced over digits, shuffled."""
    from datasets import Dataset

    digits = [i % 10 for i in range(n)]
    random.Random(seed).shuffle(digits)
    return Dataset.from_dict({"prompt": [f"{d}:" for d in digits], "digit": digits})
