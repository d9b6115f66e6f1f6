"""Joining the CRCs of consecutive pieces of a file: ``combine(crc(A), crc(B), len(B)) == crc(A + B)``.

A checkpoint's bytes are mostly in one data file per process (OCDBT's), so checksumming file by file leaves all
but one thread idle.  Its pieces are checksummed on several threads instead and their CRCs joined here, as
zlib's ``crc32_combine`` does: appending ``n`` bytes multiplies a CRC register by the matrix of ``n`` zero
bytes over GF(2), which is the product of the precomputed matrices of the powers of two in ``n``.  Both
checksums of a commit marker are reflected 32-bit CRCs with an initial and final XOR of all ones, so one rule
serves both, with their own polynomials.
"""

from __future__ import annotations

import functools

POLYNOMIALS = {"crc32c": 0x82F63B78, "crc32": 0xEDB88320}  # reflected: CRC-32C (Castagnoli), CRC-32 (zlib)
_POWERS = 48  # matrices for 2**0 .. 2**47 zero bytes: pieces up to 256 TiB


def _times(matrix: tuple[int, ...], vector: int) -> int:
    """``matrix`` (32 columns, each an int) times ``vector`` over GF(2)."""
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(matrix, column) for column in matrix)


@functools.cache
def _zero_bytes(algorithm: str) -> tuple[tuple[int, ...], ...]:
    """The matrices that append 1, 2, 4, ... zero bytes to a CRC register (``_POWERS`` of them)."""
    one_bit = (POLYNOMIALS[algorithm],) + tuple(1 << n for n in range(31))
    m = _square(_square(_square(one_bit)))  # 8 zero bits: one byte
    out = [m]
    for _ in range(_POWERS - 1):
        m = _square(m)
        out.append(m)
    return tuple(out)


def combine(crc1: int, crc2: int, len2: int, algorithm: str) -> int:
    """The CRC of ``A + B`` from ``crc1`` (of A), ``crc2`` (of B) and ``len2`` (B's length in bytes)."""
    if len2 < 0 or len2 >= 1 << _POWERS:
        raise ValueError(f"cannot join a piece of {len2} bytes")
    matrices = _zero_bytes(algorithm)
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(matrices[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2
