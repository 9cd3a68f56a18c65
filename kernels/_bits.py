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
    "constant_codes",
    "decode",
    "decode_lut",
    "decode_lut_torch",
    "pack_codes",
    "pack_codes_torch",
    "pack_signs",
    "pack_signs_torch",
    "packed_len",
    "signs",
]


def packed_len(numel: int, bits: int) -> int:
    """Bytes that hold ``numel`` codes of ``bits`` bits each."""
    per = 8 // bits
    return (numel + per - 1) // per


@njit(parallel=True, cache=True)
def pack_signs(u, out, wout):  # pragma: no cover - compiled
    """Sign bits of a uint32 view of float32 data into ``out`` (uint8[ceil(n/8)]).

    Whole 64-element groups are packed into little-endian uint64 words ``wout`` (a view of
    the first ``n // 64 * 8`` bytes of ``out``; byte k of a word holds entries 8k..8k+7), an
    inner loop the compiler vectorizes; the rest byte by byte.

    Returns:
        The count of NaN/Inf entries.
    """
    n = u.size
    words = wout.size
    bad = 0
    for w in prange(words):
        acc = np.uint64(0)
        nf = 0
        base = 64 * w
        for t in range(64):
            v = u[base + t]
            acc |= np.uint64(v >> np.uint32(31)) << np.uint64(t)
            nf += (v & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
        wout[w] = acc
        bad += nf
    for j in range(words * 8, out.size):
        b = np.uint32(0)
        for t in range(min(8, n - 8 * j)):
            v = u[8 * j + t]
            b |= (v >> np.uint32(31)) << np.uint32(t)
            bad += (v & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
        out[j] = np.uint8(b)
    return bad


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
    """Sign bits of a float32 tensor packed 8 per byte (the torch twin of :func:`pack_signs`)."""
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
    out = np.empty(packed_len(u.size, 1), np.uint8)
    return out, pack_signs(u, out, out[: u.size // 64 * 8].view(np.uint64))


def decode(packed: np.ndarray, numel: int, bits: int, lut: np.ndarray) -> np.ndarray:
    """``numel`` float32 values decoded from packed ``bits``-wide codes through ``lut``."""
    out = np.empty(numel, np.float32)
    decode_lut(packed, bits, lut, out)
    return out
