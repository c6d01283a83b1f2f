"""A tiny model that makes real tool calls, for the tests of multi-turn jobs.

The lookup task's Llama (asyncgrpo/tasks/lookup.py) taught in a few supervised steps on whole rollouts
("key K" -> a call lookup(key=K) -> the tool's answer S -> "S"), so that TRL's tool loop has calls to
parse and run from the first job: nothing of the loop is mocked. Sampling at temperature 1 still varies
the calls and the answers.
"""

from __future__ import annotations

import random

import torch

from asyncgrpo.tasks.lookup import build_model, build_tokenizer, user_prompt


def rollout_ids(tok, key: int, secret: int) -> list[int]:
    messages = [{"role": "user", "content": user_prompt(key)},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}]},
                {"role": "tool", "name": "lookup", "content": str(secret)},
                {"role": "assistant", "content": str(secret)}]
    return tok.apply_chat_template(messages, tokenize=True, return_dict=False)


def taught_tool_model(steps: int = 40, seed: int = 0):
    """(tokenizer, model) after ``steps`` supervised steps of 32 rollouts (a few seconds on a CPU)."""
    tok = build_tokenizer()
    model = build_model(seed=seed, tokenizer=tok)
    rng = random.Random(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            ids = torch.tensor([rollout_ids(tok, rng.randrange(10), rng.randrange(10)) for _ in range(32)])
            loss = model(input_ids=ids, labels=ids).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.config.max_position_embeddings = 256  # rotary positions: room for a tool's error text in the context
    return tok, model


def write_tool_model(path, steps: int = 40) -> str:
    tok, model = taught_tool_model(steps)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)
