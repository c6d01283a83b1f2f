"""A version as what changed since the one before: the changed elements of each tensor, and a checksum of
each tensor that a reader can check before it writes anything.

Between two consecutive optimizer steps nearly every element of a bf16 tensor keeps its bits (an update of
a learning rate's size is smaller than a bf16 rounding step for most weights), so a version is written as,
per tensor, the flat positions whose bits changed and their new bits; a tensor of which most elements
changed is written whole instead. Each part in the smaller of two forms:

* positions as gaps from the one before, one byte each (a longer gap gets a position in between whose bits
  did not change: writing it is a no-op), or as int32 (int64 past 2**31 elements) where that is smaller;
* new bits as one-byte differences from the old ones (a change of a few rounding steps, the usual one), where
  every difference fits, or whole.

The checksum of a tensor is a sum over its elements of a mix of (position, bits), modulo 2**32. A sum lets
both sides update it from the changed elements alone: new = old - mix(changed, old bits) + mix(changed, new
bits). A reader computes that from the elements its own tensor holds at the changed positions and the
file's values, and compares it with the file's before it writes: a file corrupted on disk is caught with
nothing written. With differences, the new bits are the held ones plus the file's, so that sum leaves out
what the reader holds: the file also carries the same sum over the bits the delta's positions held before
(``was``), which the reader's own must match, so a tensor that is not the version the delta starts from
where the delta writes is caught too. A full anchor's tensors are checked whole.
"""

from __future__ import annotations

import torch

from asyncgrpo.weights.memcopy import take

MASK32 = (1 << 32) - 1
_CHUNK = 1 << 22  # words per pass of a whole tensor's checksum (bounded temporaries)
_K = -1640531535  # an odd 32-bit constant (0x9E3779B1) as int32: torch's integer arithmetic wraps
_TWO_K = (2 * _K + 2**31) % 2**32 - 2**31  # 2 * K wrapped into int32
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def flat_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same size (a view: comparing bits, not values, so that
    NaNs and signed zeros compare as what they are)."""
    return t.reshape(-1).view(_INT_OF_SIZE[t.element_size()])


def _words(bits: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the checksum sums for the elements at ``positions``: 32-bit words (an 8-byte element is two, at
    positions 2p and 2p + 1), and their positions."""
    if bits.element_size() == 8:
        pairs = positions.to(torch.int64) * 2
        return bits.reshape(-1).view(torch.int32), torch.stack([pairs, pairs + 1], dim=1).reshape(-1)
    return bits.to(torch.int32), positions


def _weighted_sum(words: torch.Tensor, weights: torch.Tensor) -> int:
    return int((words * weights).sum(dtype=torch.int32).item())


def checksum(t: torch.Tensor) -> int:
    """The checksum of a whole tensor (module docstring). Chunk by chunk against one table of weights:
    the weight of word s + i is the table's i-th plus 2 * s * K."""
    bits = flat_bits(t)
    words = bits.view(torch.int32) if bits.element_size() == 8 else bits
    if t.device not in _WEIGHTS:
        _WEIGHTS[t.device] = (torch.arange(_CHUNK, dtype=torch.int32, device=t.device) * 2 + 1) * _K
    table = _WEIGHTS[t.device]
    total = 0
    for start in range(0, words.numel(), _CHUNK):
        part = words[start:start + _CHUNK].to(torch.int32)
        offset_sum = int(part.sum(dtype=torch.int32).item()) * 2 * start * _K
        total += _weighted_sum(part, table[:part.numel()]) + offset_sum
    return total & MASK32


def position_sums(positions: torch.Tensor, old_bits: torch.Tensor, new_bits: torch.Tensor) -> tuple[int, int]:
    """The checksum's sums over the elements at ``positions`` only, of ``old_bits`` and of ``new_bits`` (their
    weights computed once): the checksum after is the one before minus the first plus the second (``updated``),
    and the first is what a reader checks the bits it holds against (``was``)."""
    if positions.numel() == 0:
        return 0, 0
    old_words, word_positions = _words(old_bits, positions)
    return word_sums(word_positions, old_words.reshape(-1), _words(new_bits, positions)[0].reshape(-1))


def word_sums(word_positions: torch.Tensor, old_words: torch.Tensor, new_words: torch.Tensor) -> tuple[int, int]:
    """``position_sums`` of the words (int32) at ``word_positions``."""
    weights = word_positions.to(torch.int32).mul(_TWO_K).add_(_K)  # (2 * position + 1) * K, wrapping
    return _weighted_sum(old_words, weights) & MASK32, _weighted_sum(new_words, weights) & MASK32


def updated(checksum: int, before: int, after: int) -> int:
    return (checksum - before + after) & MASK32


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


MAX_GAP = 255  # what one byte of a gap holds


def _with_fillers(positions: torch.Tensor) -> torch.Tensor:
    """``positions`` (sorted int64) and one more every MAX_GAP where a gap is longer, in order (no sort: each
    position moves up by the fillers before it, and the fillers take the slots left)."""
    gaps = torch.diff(positions, prepend=positions.new_tensor([-1]))
    long = (gaps > MAX_GAP).nonzero().reshape(-1)  # few: the work below is over these
    if long.numel() == 0:
        return positions
    counts = (gaps[long] - 1) // MAX_GAP
    shifts = torch.zeros_like(positions)
    shifts[long] = counts
    slots = torch.arange(positions.numel(), device=positions.device) + torch.cumsum(shifts, 0)
    merged = positions.new_empty(positions.numel() + int(counts.sum()))
    merged[slots] = positions
    is_filler = torch.ones(merged.numel(), dtype=torch.bool, device=positions.device)
    is_filler[slots] = False
    first = torch.cumsum(counts, 0) - counts  # each long gap's first filler among all fillers
    steps = torch.arange(int(counts.sum()), device=positions.device) - first.repeat_interleave(counts) + 1
    merged[is_filler] = (positions[long] - gaps[long]).repeat_interleave(counts) + steps * MAX_GAP
    return merged


def encode(previous_bits: torch.Tensor, new_bits: torch.Tensor, positions: torch.Tensor, checksum: int
           ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, int]:
    """A tensor's delta: its parts by kind (``gap`` or ``idx``, then ``dif`` or ``val``, and ``was``), the
    positions it writes (no-op positions included), the bits it writes, and the tensor's checksum after
    (``checksum``: before)."""
    parts = {}
    filled = _with_fillers(positions)
    if filled.numel() < positions.numel() * index_dtype(new_bits.numel()).itemsize:
        positions = filled
        parts["gap"] = torch.diff(positions, prepend=positions.new_tensor([-1])).to(torch.uint8)
    else:
        parts["idx"] = positions.to(index_dtype(new_bits.numel()))
    old, values = take(previous_bits, positions), take(new_bits, positions)
    before, after = position_sums(positions, old, values)
    parts["was"] = torch.tensor([before], dtype=torch.int64)
    if new_bits.element_size() < 8:  # (4-byte bits may wrap: old + difference wraps back the same way)
        difference = values.to(torch.int32) - old.to(torch.int32)
        if int(difference.min()) >= -128 and int(difference.max()) < 128:
            parts["dif"] = difference.to(torch.int8)
    if "dif" not in parts:
        parts["val"] = values
    return parts, positions, values, updated(checksum, before, after)


_DECODE_CHUNK = 1 << 20  # positions decoded at a time: the temporaries stay in the caches


def decode(parts: dict[str, torch.Tensor], held: torch.Tensor, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """A delta's positions (int64) and the bits it writes, given the flat tensor it applies to
    (``held``, on any device; its values read in the files' ``dtype``), and the checksum's sums over the bits held
    and the bits written at those positions (``position_sums``). Chunk by chunk: at a learning rate of 1e-5 a sixth
    of a model's elements change, and each step over all of them at once would pass through main memory."""
    gaps = parts.get("gap")
    indices = parts["idx"] if gaps is None else None
    count = (gaps if gaps is not None else indices).numel()
    values = parts["dif"] if "dif" in parts else parts["val"]
    if values.numel() != count:
        raise ValueError(f"a delta of {count} positions with {values.numel()} values")
    if "dif" in parts and (dtype.itemsize == 8 or values.dtype != torch.int8):  # (never written so: ``encode``)
        raise ValueError(f"one-byte differences of {values.dtype} for {dtype} elements")
    if "dif" not in parts and values.dtype != _INT_OF_SIZE[dtype.itemsize]:
        raise ValueError(f"values of {values.dtype} for {dtype} elements")
    held = held.detach()
    positions = torch.empty(count, dtype=torch.int64)
    written = parts["val"] if "dif" not in parts else torch.empty(count, dtype=_INT_OF_SIZE[dtype.itemsize])
    before = after = 0
    last = -1  # the position before the chunk's first
    for start in range(0, count, _DECODE_CHUNK):
        end = start + _DECODE_CHUNK
        at = positions[start:end]
        if gaps is not None:
            torch.cumsum(gaps[start:end], 0, out=at).add_(last)
            lowest, highest = int(at[0]), int(at[-1])
            last = highest
        else:
            at.copy_(indices[start:end])
            lowest, highest = (int(x) for x in at.aminmax())
        if lowest < 0 or highest >= held.numel():  # (on a GPU an index out of range would end the process)
            raise IndexError(f"a delta's position lies outside the tensor's {held.numel()} elements")
        old = flat_bits(take(held, at.to(held.device)).to(dtype)).cpu()
        new = written[start:end]
        if "dif" in parts:  # (wrapping as the writer's difference did)
            torch.add(old, parts["dif"][start:end], out=new)
        if old.element_size() == 8:
            sums = position_sums(at, old, new)
        else:  # ``word_sums``, its weights computed in place and each sum one pass
            weights = at.to(torch.int32).mul_(_TWO_K).add_(_K)
            sums = int(torch.dot(weights, old.to(torch.int32))), int(torch.dot(weights, new.to(torch.int32)))
        before, after = before + sums[0], after + sums[1]
    return positions, written, before & MASK32, after & MASK32


def mostly_changed(numel: int, changed: int) -> bool:
    """More than half of the tensor changed: it goes whole, without a look at what its delta would weigh."""
    return changed * 2 > numel


def nbytes(parts: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in parts.values())
