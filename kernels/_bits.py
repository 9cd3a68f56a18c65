"""Bit packing shared by the sign, 1-bit, ternary and low-bit codecs.

Layout (both backends): code ``i`` of a ``bits``-wide stream (bits in 1, 2, 4, 8) lives in
byte ``i // (8 // bits)`` at bit offset ``bits * (i % (8 // bits))`` (little-endian within the
byte, like ``numpy.packbits(bitorder="little")`` for bits=1). Padding bits of the last byte are
zero. A sign bit is the IEEE-754 sign bit of the float32 value (so -0.0 counts as negative).

Decoding goes through a lookup table of ``2**bits`` float32 values, so every packed codec
shares one decode kernel per backend.

numba kernels write into output arrays allocated by the caller with numpy: numpy asks the
kernel for transparent huge pages on large allocations, numba's own allocator does not, and
the page faults of a fresh 64 MiB array cost more than the kernel itself (measured 3x).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

__all__ = [
    "add_lut_bits",
    "constant_codes",
    "decode",
    "decode_lut",
    "decode_lut_torch",
    "pack_codes",
    "pack_codes_torch",
    "pack_signs_torch",
    "packed_len",
    "signs",
]


def packed_len(numel: int, bits: int) -> int:
    """Bytes that hold ``numel`` codes of ``bits`` bits each."""
    per = 8 // bits
    return (numel + per - 1) // per


# Multiplying a little-endian word of eight 0/1 bytes by this constant moves byte k's bit to
# bit 56 + k with no carries below (the classic "bit gather" multiply).
_GATHER8 = np.uint64(0x0102040810204080)
_U56 = np.uint64(56)


@njit(parallel=True, cache=True)
def sign_bytes(u, tmp):  # pragma: no cover - compiled
    """tmp[i] = sign bit of entry i (0/1); returns the count of NaN/Inf entries.

    A plain element-wise loop that vectorizes; :func:`gather_bits` then packs 8 bytes per
    output byte with one multiply, which is 4x faster per core than shifting bits into place.
    """
    bad = 0
    for i in prange(u.size):
        v = u[i]
        tmp[i] = np.uint8(v >> np.uint32(31))
        bad += np.int64(((v & np.uint32(0x7F800000)) + np.uint32(0x800000)) >> np.uint32(31))
    return bad


@njit(parallel=True, cache=True)
def gather_bits(t64, out):  # pragma: no cover - compiled
    """out[j] = the low bits of the 8 bytes of t64[j] (0/1 each), byte k -> bit k."""
    for j in prange(t64.size):
        out[j] = np.uint8((t64[j] * _GATHER8) >> _U56)


@njit(parallel=True, cache=True)
def decode_lut(packed, bits, lut, out):  # noqa: PLR0912  # pragma: no cover - compiled
    """Unpack ``out.size`` codes of ``bits`` bits, each mapped through ``lut``, into ``out``.

    One loop per code width so that each inner loop has a constant trip count.
    """
    n = out.size
    per = 8 // bits
    full = n // per
    if bits == 8:
        for i in prange(n):
            out[i] = lut[packed[i]]
    elif bits == 1:
        for j in prange(full):
            b = np.int64(packed[j])
            for t in range(8):
                out[8 * j + t] = lut[(b >> t) & 1]
    elif bits == 2:
        for j in prange(full):
            b = np.int64(packed[j])
            for t in range(4):
                out[4 * j + t] = lut[(b >> (2 * t)) & 3]
    else:
        for j in prange(full):
            b = np.int64(packed[j])
            for t in range(2):
                out[2 * j + t] = lut[(b >> (4 * t)) & 15]
    mask = (1 << bits) - 1
    if full * per < n:
        b = np.int64(packed[full])
        for t in range(n - full * per):
            out[full * per + t] = lut[(b >> (bits * t)) & mask]


@njit(parallel=True, cache=True)
def add_lut_bits(packed, lut, out):  # pragma: no cover - compiled
    """out[i] += lut[bit i of packed] (bits=1), in place: a decoded payload added to a sum
    (or, with the table negated, subtracted: ``a + -b`` is ``a - b`` exactly) without the
    decoded array. One plain loop per byte, as :func:`decode_lut`'s, so it vectorizes."""
    n = out.size
    full = n // 8
    for j in prange(full):
        b = np.int64(packed[j])
        for t in range(8):
            out[8 * j + t] += lut[(b >> t) & 1]
    if full * 8 < n:
        b = np.int64(packed[full])
        for t in range(n - full * 8):
            out[full * 8 + t] += lut[(b >> t) & 1]


@njit(parallel=True, cache=True)
def pack_codes(codes, bits, out):  # pragma: no cover - compiled
    """Pack uint8 codes < 2**bits (bits 2 or 4) into ``out`` (layout in the module doc)."""
    n = codes.size
    per = 8 // bits
    full = n // per
    if bits == 2:
        for j in prange(full):
            c = codes[4 * j: 4 * j + 4]
            out[j] = np.uint8(c[0] | (c[1] << 2) | (c[2] << 4) | (c[3] << 6))
    else:
        for j in prange(full):
            out[j] = np.uint8(codes[2 * j] | (codes[2 * j + 1] << 4))
    if full * per < n:
        b = 0
        for t in range(n - full * per):
            b |= np.int64(codes[full * per + t]) << (bits * t)
        out[full] = np.uint8(b)


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    per = 8 // bits
    return torch.arange(0, 8, bits, dtype=torch.int32, device=device)[:per]


def pack_codes_torch(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D integer tensor of codes < 2**bits into uint8 (layout in the module doc)."""
    per = 8 // bits
    n = codes.numel()
    if bits == 8:
        return codes.to(torch.uint8)
    padded = torch.zeros(packed_len(n, bits) * per, dtype=torch.int32, device=codes.device)
    padded[:n] = codes
    shifted = padded.view(-1, per) << _shifts(bits, codes.device)
    return shifted.sum(dim=1, dtype=torch.int32).to(torch.uint8)


def pack_signs_torch(flat: torch.Tensor) -> torch.Tensor:
    """Sign bits of a float32 tensor packed 8 per byte (the torch twin of :func:`signs`)."""
    return pack_codes_torch((flat.view(torch.int32) < 0).to(torch.int32), 1)


def decode_lut_torch(packed: torch.Tensor, n: int, bits: int, lut: torch.Tensor) -> torch.Tensor:
    """The torch twin of :func:`decode_lut`."""
    if bits == 8:
        return lut[packed.long()]
    mask = (1 << bits) - 1
    codes = (packed.to(torch.int32).unsqueeze(1) >> _shifts(bits, packed.device)) & mask
    return lut[codes.reshape(-1)[:n].long()]


def constant_codes(numel: int, bits: int, code: int) -> np.ndarray:
    """``numel`` copies of one code packed ``bits`` per code (zero padding bits)."""
    per = 8 // bits
    byte = sum(code << (bits * t) for t in range(per))
    out = np.full(packed_len(numel, bits), byte, np.uint8)
    rest = numel % per
    if rest:
        out[-1] = sum(code << (bits * t) for t in range(rest))
    return out


def signs(u: np.ndarray) -> tuple[np.ndarray, int]:
    """Packed sign bits of a uint32 view of float32 data, and the count of NaN/Inf."""
    nbytes = packed_len(u.size, 1)
    tmp = np.empty(nbytes * 8, np.uint8)
    tmp[u.size:] = 0  # padding bits of the last byte
    bad = sign_bytes(u, tmp)
    out = np.empty(nbytes, np.uint8)
    gather_bits(tmp.view(np.uint64), out)
    return out, bad


def decode(packed: np.ndarray, numel: int, bits: int, lut: np.ndarray) -> np.ndarray:
    """``numel`` float32 values decoded from packed ``bits``-wide codes through ``lut``."""
    out = np.empty(numel, np.float32)
    decode_lut(packed, bits, lut, out)
    return out
