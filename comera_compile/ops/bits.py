"""Bit packing: bool flags stored eight per byte, so a mask kept for the backward costs 1/8 byte per element."""

from __future__ import annotations

import math
import sys

import torch

from comera_compile.ops.buffers import Scratch

__all__ = ["pack_bits", "unpack_bits", "pack_into", "unpack", "bit_slice"]


# ---------------------------------------------------------------------------------------------------------
# Bit packing: uint8 0/1 flags <-> 8 per byte, with int64 arithmetic on 8 bytes at a time (little endian)

_PACK = 0x0102040810204080            # gathers bit 0 of each byte of a word into the top byte
_SPREAD = 0x0101010101010101          # copies a byte into all eight
_SELECT = 0x8040201008040201 - 2**64  # byte k keeps bit k (constants above 2**63 written as signed int64)
_ROUND = 0x7F7F7F7F7F7F7F7F           # sets a byte's top bit when the byte is non-zero
_ONES = 0x0101010101010101
_LITTLE = sys.byteorder == "little"


def pack_into(flags: torch.Tensor, out: torch.Tensor, scratch: Scratch | None = None) -> None:
    """Pack uint8 0/1 flags into `out` (uint8, ceil(len / 8)); flags is padded with zeros as needed."""
    n = flags.numel()
    if n % 8 or not _LITTLE:
        padded = flags.new_zeros(8 * out.numel())
        padded[:n] = flags
        flags = padded
    if not _LITTLE:
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=flags.device)
        out.copy_((flags.view(-1, 8) * weights).sum(-1, dtype=torch.uint8))
        return
    words = flags.view(torch.int64)
    tmp = scratch.get("pack", words.numel(), torch.int64) if scratch is not None else torch.empty_like(words)
    torch.mul(words, _PACK, out=tmp)  # wraps around: only the top byte is wanted
    out.copy_(tmp.bitwise_right_shift_(56))  # int64 -> uint8 keeps the low byte


def unpack(packed: torch.Tensor, n: int, scratch: Scratch | None = None) -> torch.Tensor:
    """The first n uint8 0/1 flags packed in `packed` (bit k of byte j is flag 8j + k)."""
    if not _LITTLE:
        shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
        return ((packed.unsqueeze(-1) >> shifts) & 1).view(-1)[:n]
    words = scratch.get("unpack", packed.numel(), torch.int64) if scratch is not None else \
        torch.empty(packed.numel(), dtype=torch.int64, device=packed.device)
    words.copy_(packed).mul_(_SPREAD).bitwise_and_(_SELECT).add_(_ROUND)
    return words.bitwise_right_shift_(7).bitwise_and_(_ONES).view(torch.uint8)[:n]


def bit_slice(packed: torch.Tensor, a: int, b: int, scratch: Scratch | None = None) -> torch.Tensor:
    """uint8 0/1 flags a..b (a a multiple of 8) of a packed tensor."""
    return unpack(packed[a // 8:(b + 7) // 8], b - a, scratch)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool (or 0/1) tensor as bits, 8 per byte, in row-major order: uint8 of length ceil(numel / 8)."""
    flags = mask.reshape(-1).to(torch.uint8)
    out = torch.empty((flags.numel() + 7) // 8, dtype=torch.uint8, device=mask.device)
    pack_into(flags, out)
    return out


def unpack_bits(packed: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The bool tensor of `shape` that pack_bits packed."""
    n = math.prod(shape)
    if packed.dtype != torch.uint8 or packed.numel() != (n + 7) // 8:
        raise ValueError(f"unpack_bits needs the uint8 tensor pack_bits made from {n} elements "
                         f"({(n + 7) // 8} bytes); got {packed.numel()} elements of {packed.dtype}")
    return unpack(packed, n).view(torch.bool).reshape(shape)
