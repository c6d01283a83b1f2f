"""Random draws that depend only on a row's seed, its token's index and the vocabulary position: the continuous
engine's rows sample the same tokens whichever slots, steps and other jobs they decode beside
(worker/decoding/continuous.py)."""

from __future__ import annotations

import torch

# splitmix64's constants, as signed 64-bit integers (torch has no uint64 arithmetic)
GOLDEN = 0x9E3779B97F4A7C15 - 2**64
MIX1 = 0xBF58476D1CE4E5B9 - 2**64
MIX2 = 0x94D049BB133111EB - 2**64


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 (torch's is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def seeded_exponentials(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) draws [rows, vocab] that depend only on each row's seed, its counter (the token's index) and the
    vocabulary position: splitmix64 (Steele et al.) of ``seed + (counter * vocab + position) * golden``, its top 23
    bits a uniform in (0, 1). Integer products wrap, as the hash wants. In place where it can: run eagerly (the
    engine on a CPU), each operation is a pass over [rows, vocab] int64s, and a new tensor each would cost as much
    again."""
    x = counters[:, None] * vocab + torch.arange(vocab, device=seeds.device)[None, :]
    x *= GOLDEN
    x += seeds[:, None]
    x ^= _shift_right(x, 30)
    x *= MIX1
    x ^= _shift_right(x, 27)
    x *= MIX2
    # splitmix64's last step, x ^ (x >>> 31), leaves the top 23 bits as they are: it is left out.
    return unit_interval(x).log_().neg_()


def unit_interval(x: torch.Tensor) -> torch.Tensor:
    """The top 23 bits of int64 ``x`` as a float32 strictly inside (0, 1): (k + 0.5) / 2**23 is exact in float32,
    so no draw rounds to 1 (with 24 bits the largest does, and its Exp(1) draw of 0 wins every race)."""
    u = _shift_right(x, 41).to(torch.float32)
    u += 0.5
    return u.div_(2**23)


def row_seed(job_seed: int, row: int) -> int:
    """Row ``row`` of a job's seed for ``seeded_exponentials`` (rows must differ: a group of equal samples teaches
    nothing), as a signed 64-bit integer."""
    z = (job_seed * 0x9E3779B97F4A7C15 + row * 0xD1B54A32D192ED03 + 1) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    z ^= z >> 31
    return z - 2**64 if z >= 2**63 else z
