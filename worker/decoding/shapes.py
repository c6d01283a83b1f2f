"""The static shapes the compiled decoders allocate and read: a static cache's prompt part, the prefixes of the cache
a decoding step's graphs read, and buffers whose addresses a compiled step may take as fixed."""

from __future__ import annotations

import torch

PROMPT_BUCKET = 16  # the static cache's prompt part is a multiple of this many tokens


def bucketed(prompt_tokens: int) -> int:
    """The static cache's prompt part for prompts of up to ``prompt_tokens`` tokens: a multiple of PROMPT_BUCKET."""
    return -(-prompt_tokens // PROMPT_BUCKET) * PROMPT_BUCKET


# Graphs of GraphDecoding's step, each reading a longer prefix of the cache: with n, a call that runs to the cap reads
# (n + 1) / 2n of the completion's columns on average (all of them with 1). Each is compiled in the warm-up, and
# counted against torch.compile's limit of graphs of one function (step.py GRAPHS_PER_FUNCTION), for each decoder
# apart where torch can (OwnStep's step_graphs_of_its_own): 4, and 4 more for a longer prompt's cache.
ATTENTION_BUCKETS = 4


def column_buckets(prompt_part: int, max_new: int, buckets: int) -> list[int]:
    """The prefixes of the cache (in columns) the decoding step's graphs read: the prompt part and up to ``buckets``
    equal parts of the ``max_new`` completion columns (multiples of PROMPT_BUCKET), the last the whole cache."""
    width = bucketed(-(-max_new // buckets))
    return sorted({prompt_part + min(k * width, max_new) for k in range(1, buckets + 1)})


def static_buffer(*shape: int, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Zeros whose address a compiled step may take as fixed (CUDA graphs read and write them in place)."""
    t = torch.zeros(shape, dtype=dtype, device=device)
    torch._dynamo.mark_static_address(t)
    return t
