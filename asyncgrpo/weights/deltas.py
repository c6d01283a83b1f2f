"""A version as what changed since the one before: the changed elements of each tensor, and a checksum of
each tensor that a reader can check before it writes anything.

Between two consecutive optimizer steps nearly every element of a bf16 tensor keeps its bits (an update of
a learning rate's size is smaller than a bf16 rounding step for most weights), so a version is written as,
per tensor, the flat positions whose bits changed and their new values; a tensor of which most elements
changed is written whole instead.

The checksum of a tensor is a sum over its elements of a mix of (position, bits), modulo 2**32. A sum lets
both sides update it from the changed elements alone: new = old - mix(changed, old bits) + mix(changed, new
bits). A reader computes that from the elements its own tensor holds at the changed positions and the
file's values, and compares it with the file's before it writes: a file corrupted on disk, or a tensor that
is not the version the delta starts from, is caught with nothing written. A full anchor's tensors are
checked whole.
"""

from __future__ import annotations

import torch

MASK32 = (1 << 32) - 1
_CHUNK = 1 << 22  # words per pass of a whole tensor's checksum (bounded temporaries)
_K = -1640531535  # an odd 32-bit constant (0x9E3779B1) as int32: torch's integer arithmetic wraps
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def flat_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same size (a view: comparing bits, not values, so that
    NaNs and signed zeros compare as what they are)."""
    return t.reshape(-1).view(_INT_OF_SIZE[t.element_size()])


def _words(bits: torch.Tensor, positions: torch.Tensor | None = None):
    """What the checksum sums: 32-bit words (an 8-byte element is two, at positions 2p and 2p + 1)."""
    if bits.element_size() == 8:
        words = bits.view(torch.int32)
        if positions is None:
            return words, None
        pairs = positions.to(torch.int64) * 2
        return words.reshape(-1, 2), torch.stack([pairs, pairs + 1], dim=1).reshape(-1)
    return bits.to(torch.int32), positions


def _weighted_sum(words: torch.Tensor, weights: torch.Tensor) -> int:
    return int((words * weights).sum(dtype=torch.int32).item())


def _mixed_sum(positions: torch.Tensor, bits: torch.Tensor) -> int:
    """sum(bits * (2 * position + 1) * K) modulo 2**32 over the given elements."""
    if positions.numel() == 0:
        return 0
    words, positions = _words(bits, positions)
    weights = (positions.to(torch.int32) * 2 + 1) * _K
    return _weighted_sum(words.reshape(-1), weights) & MASK32


def checksum(t: torch.Tensor) -> int:
    """The checksum of a whole tensor (module docstring). Chunk by chunk against one table of weights:
    the weight of word s + i is the table's i-th plus 2 * s * K."""
    words, _ = _words(flat_bits(t))
    words = words.reshape(-1)
    if t.device not in _WEIGHTS:
        _WEIGHTS[t.device] = (torch.arange(_CHUNK, dtype=torch.int32, device=t.device) * 2 + 1) * _K
    table = _WEIGHTS[t.device]
    total = 0
    for start in range(0, words.numel(), _CHUNK):
        part = words[start:start + _CHUNK]
        offset_sum = int(part.sum(dtype=torch.int32).item()) * 2 * start * _K
        total += _weighted_sum(part, table[:part.numel()]) + offset_sum
    return total & MASK32


def updated_checksum(old: int, positions: torch.Tensor, old_bits: torch.Tensor, new_bits: torch.Tensor) -> int:
    """The checksum after the elements at ``positions`` changed from ``old_bits`` to ``new_bits``."""
    return (old - _mixed_sum(positions, old_bits) + _mixed_sum(positions, new_bits)) & MASK32


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def worth_a_delta(numel: int, changed: int, element_size: int) -> bool:
    """Positions and values take fewer bytes than the whole tensor."""
    return changed * (index_dtype(numel).itemsize + element_size) < numel * element_size
