"""Random numbers whose bytes are the same on every machine, CPU kernel, thread count and device.

Everything the project generates and then pins (fixtures, calibration and evaluation sets) is
drawn here. Library samplers are not: torch's `randn` and friends pick a vectorised kernel per
CPU (default / AVX2 / AVX512) with different transcendental approximations, so the same seed
gives different bytes on another machine.

The bit source is a counter-based 32-bit integer hash (a "lowbias32"-style xorshift-multiply
mixer from Wellons' hash-prospector, multipliers below 2^31 so that a 32-bit value times one
stays below 2^63: int64 arithmetic never overflows, on the CPU or the GPU). Value i of a stream
is a pure function of (key, i), so tensors can be generated in chunks, in any order, on any
device. A key is the SHA-256 of the stream's full name: no two names share a stream.

Bits become floats with IEEE-exact operations only (+ - x / and sqrt, each correctly rounded,
in a fixed order, in float64): uniforms, Irwin-Hall normals, and Student-t by Bailey's polar
method (exact for the t distribution, and for 4 or 8 degrees of freedom it needs only square
roots). Rounding to float32 and then to bfloat16 is done here too, the latter with integer
arithmetic (round to nearest even), so no conversion kernel is trusted either.
"""
from __future__ import annotations

import hashlib
import math

import torch

MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x21F0AAAD, 0x735A2D97  # hash-prospector [16 21f0aaad 15 735a2d97 15]; both < 2^31
CHUNK = 1 << 22  # elements per generation step: bounds temporary memory for 600M-element tables
_ATTEMPT_BITS = 6  # Bailey's method accepts with probability pi/4: 64 tries never run out


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2^32) on int64 tensors, no overflow."""
    x = x ^ (x >> 16)
    x = (x * _M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & MASK32
    return x ^ (x >> 15)


class Stream:
    """An infinite array of 32-bit words addressed by counter, keyed by a name."""

    def __init__(self, name: str):
        digest = hashlib.sha256(name.encode()).digest()
        self.name = name
        self.k0, self.k1, self.k2 = (int.from_bytes(digest[i:i + 4], "little") for i in (0, 4, 8))

    def bits(self, counter: torch.Tensor) -> torch.Tensor:
        """32-bit words (int64 in [0, 2^32)) at the given non-negative int64 counters."""
        lo, hi = counter & MASK32, counter >> 32
        h = _mix32(lo ^ self.k0)
        h = _mix32(h ^ hi ^ self.k1)
        return _mix32(h ^ self.k2)

    def uniform(self, counter: torch.Tensor) -> torch.Tensor:
        """float64 in (0, 1): (word + 1/2) / 2^32, exact."""
        return (self.bits(counter).to(torch.float64) + 0.5) * (1.0 / 4294967296.0)

    def integers(self, counter: torch.Tensor, n: int) -> torch.Tensor:
        """int64 in [0, n): the high part of word * n (exact; n < 2^31)."""
        if not 0 < n < 1 << 31:
            raise ValueError(f"integers: n must be in [1, 2^31), got {n}")
        return (self.bits(counter) * n) >> 32


def _counters(start: int, count: int, device) -> torch.Tensor:
    return torch.arange(start, start + count, dtype=torch.int64, device=device)


def _chunked(numel: int, device, fill, start: int = 0) -> torch.Tensor:
    out = torch.empty(numel, dtype=torch.float64, device=device)
    for s in range(0, numel, CHUNK):
        n = min(CHUNK, numel - s)
        out[s:s + n] = fill(_counters(start + s, n, device))
    return out


# Every sampler draws elements [start, start + numel) of its stream: a large tensor can be made a
# slice of rows at a time (float64 of a whole 600M-entry table would not fit in memory).


def uniform(name: str, shape, device="cpu", start: int = 0) -> torch.Tensor:
    """float64 uniforms in (0, 1)."""
    st = Stream(name)
    return _chunked(math.prod(shape), device, st.uniform, start).reshape(shape)


def normal(name: str, shape, device="cpu", start: int = 0) -> torch.Tensor:
    """Unit-variance Irwin-Hall(12) normals: 12 uniforms summed in order, minus 6 (bounded at +-6)."""
    st = Stream(name)

    def fill(j):
        acc = st.uniform(j * 12)
        for m in range(1, 12):
            acc = acc + st.uniform(j * 12 + m)
        return acc - 6.0

    return _chunked(math.prod(shape), device, fill, start).reshape(shape)


def student_t(name: str, shape, df: int, device="cpu", start: int = 0) -> torch.Tensor:
    """Unit-variance Student-t samples (Bailey's polar method).

    U, V uniform on (-1, 1), W = U^2 + V^2, accepted if W < 1; then
    T = U * sqrt(df * (W^(-2/df) - 1) / W) is exactly t-distributed with df degrees of freedom.
    W^(-2/df) is 1/sqrt(W) for df=4 and 1/sqrt(sqrt(W)) for df=8. Element j's attempt a uses
    counters ((j << 6 | a) << 1) and +1, so every element depends only on (name, j).
    """
    roots = {4: 1, 8: 2}.get(df)
    if roots is None:
        raise ValueError(f"student_t: df must be 4 or 8 (square roots only), got {df}")
    st = Stream(name)
    unit = 1.0 / math.sqrt(df / (df - 2))

    def fill(j):
        out = torch.empty(j.shape, dtype=torch.float64, device=j.device)
        todo = torch.arange(j.numel(), device=j.device)
        for attempt in range(1 << _ATTEMPT_BITS):
            c = ((j[todo] << _ATTEMPT_BITS) | attempt) << 1
            u = st.uniform(c) * 2.0 - 1.0
            v = st.uniform(c + 1) * 2.0 - 1.0
            w = u * u + v * v
            ok = w < 1.0
            u, w = u[ok], w[ok]
            p = w
            for _ in range(roots):
                p = torch.sqrt(p)  # p = W^(2/df)
            t = u * torch.sqrt(df * (1.0 / p - 1.0) / w)
            out[todo[ok]] = t * unit
            todo = todo[~ok]
            if todo.numel() == 0:
                return out
        raise RuntimeError(f"student_t {name}: rejection sampling did not finish")  # p ~ 1e-43

    return _chunked(math.prod(shape), device, fill, start).reshape(shape)


def permutation(name: str, n: int, device="cpu") -> torch.Tensor:
    """A permutation of range(n) (n < 2^32): positions sorted by their hashed words, which are
    distinct because the hash is a bijection."""
    keys = Stream(name).bits(_counters(0, n, device))
    return torch.argsort(keys, stable=True)


def power(base: float, k: int) -> float:
    """base ** k by repeated multiplication (libm's pow is not correctly rounded everywhere)."""
    out = 1.0
    for _ in range(k):
        out *= base
    return out


def to_float32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, round to nearest even (an IEEE conversion: the same on every kernel)."""
    return x.to(torch.float32)


def to_bfloat16(x: torch.Tensor) -> torch.Tensor:
    """float64 -> bfloat16 via float32, rounded to nearest even with integer arithmetic
    (no NaN or Inf expected: fixtures are finite)."""
    bits = to_float32(x).view(torch.int32).to(torch.int64) & MASK32
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    bits = torch.where(bits >= 1 << 15, bits - (1 << 16), bits)  # as signed int16
    return bits.to(torch.int16).view(torch.bfloat16)
