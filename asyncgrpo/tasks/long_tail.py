"""Completions with a long tail of lengths, from a model built in-process: the workload on which decoders are
compared (bench/long_tail.py --lengths long-tail, tests/worker/test_continuous.py).

Real completion lengths run from tens of tokens to the ``max_completion_length`` cap, which a few rows reach. A
randomly initialised model ends its rows almost never (EOS is one token among the vocabulary) or, with sharp
logits, erratically. ``end_with_probability`` rewires a Llama-like model so that every step samples EOS with one
stated probability p, whatever the prompt and the tokens before: lengths are geometric with mean 1 / p, cut at the
cap. The rest of the model still runs as it is (every layer, the whole vocabulary), so a decoding step costs what
it costs on a real model of that shape.
"""

from __future__ import annotations

import math

import torch

CONSTANT_SCALE = 1e5  # the constant coordinate against an embedding coordinate: it must outweigh what 24 layers add


@torch.no_grad()
def end_with_probability(model: torch.nn.Module, eos_token_id: int, p: float) -> None:
    """Makes every decoding step of ``model`` (its layers' outputs small: an initializer_range of about 0.02) sample
    ``eos_token_id`` with probability about ``p`` and the other tokens about uniformly.

    The first coordinate of every token's embedding becomes a large constant: it dominates the residual stream, so
    after the final RMS norm it is about sqrt(hidden) whatever the token, and the others are small. The output
    rows read that coordinate only for EOS, with the logit that gives it probability p among equal others."""
    embeddings = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    if embeddings.data_ptr() == head.data_ptr():
        raise ValueError("tied input and output embeddings: build the model with tie_word_embeddings=False")
    vocab, hidden = head.shape
    embeddings[:, 0] = CONSTANT_SCALE * embeddings[:, 1:].std()
    head[:, 0] = 0.0
    logit = math.log(p / (1 - p) * (vocab - 1))
    head[eos_token_id, 0] = logit / math.sqrt(hidden)


def geometric_mean_length(p: float, cap: int) -> float:
    """The mean length of completions that end with probability ``p`` at each token (EOS included), cut at ``cap``."""
    return (1 - (1 - p) ** cap) / p
