"""Blockwise e4m3 quantisation emulated in fp32 arithmetic, bit-identical to `ops.quant`'s reference.

`quantize_fp8_blockwise` stores e4m3 and `dequantize_fp8_blockwise` converts it back; on a CPU the
float8 -> fp32 conversion is an unvectorised per-element loop (tens of times the cost of an fp32
multiply) and the fp32 -> float8 cast is several times one. The emulation of an fp8 GEMM only needs
the values, so this form keeps them in fp32: `round_to_e4m3` rounds an fp32 tensor onto e4m3's grid
exactly as the cast does (round to nearest even, 3 mantissa bits, subnormal step 2^-9), and the
quantise / dequantise pair mirrors the reference op for op, with the scales broadcast over each tile
instead of materialised by `repeat_interleave`. tests/ops/test_fp8_emulation.py checks it against the
reference and torch's cast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltamoe.ops.quant import FP8_MAX, _block_scales

E4M3_MIN_NORMAL = 2.0 ** -6
_DROPPED_BITS = 23 - 3  # fp32 mantissa bits e4m3 does not keep
_EXPONENT_MASK = 0x7F800000


def round_to_e4m3(t: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-448, 448] (or NaN) -> the nearest e4m3 values, ties to even, in fp32: the same
    bits as `t.to(torch.float8_e4m3fn).float()`, the sign of zero included."""
    return round_to_e4m3_magnitude(t.abs()).copysign_(t)


def round_to_e4m3_magnitude(mag: torch.Tensor) -> torch.Tensor:
    """`round_to_e4m3` of non-negative values (or NaN), in place."""
    # 2^E of |t|'s binade (the exponent bits alone), floored at e4m3's smallest normal binade, whose
    # step (2^-9) the subnormals share.
    binade = (mag.view(torch.int32) & _EXPONENT_MASK).view(torch.float32).clamp_min_(E4M3_MIN_NORMAL)
    # fp32's own round-to-nearest-even at a magnitude where its step is e4m3's step in that binade:
    # adding 2^(E+20) leaves 23 - 20 = 3 mantissa bits of |t|, and subtracting it back is exact.
    shift = binade.mul_(2.0 ** _DROPPED_BITS)
    return mag.add_(shift).sub_(shift)


def _fitted_block(shape: torch.Size, block: tuple[int, int]) -> tuple[int, int]:
    """`block`, shrunk along a dim the tensor spans in one tile: the same tiles without the padding."""
    return max(1, min(block[0], shape[0])), max(1, min(block[1], shape[1]))


def _tiles(t: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """[R, C] fp32 -> [R'/br, br, C'/bc, bc] tiles of the zero-padded tensor (padded only where needed;
    zero padding leaves a tile's absmax as it is)."""
    br, bc = _fitted_block(t.shape, block)
    rows, cols = t.shape
    pr, pc = -rows % br, -cols % bc
    padded = F.pad(t.float(), (0, pc, 0, pr)) if pr or pc else t.float().contiguous()
    return padded.view((rows + pr) // br, br, (cols + pc) // bc, bc), pr, pc


def quantize_fp8_blockwise_fp32(t: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`quant.quantize_fp8_blockwise` with the e4m3 values returned as fp32 (the same values)."""
    if t.dim() != 2:
        raise ValueError(f"t: expected [R, C], got shape {tuple(t.shape)}")
    rows, cols = t.shape
    blocks, pr, pc = _tiles(t, block)
    mag = blocks.abs()
    scale = _block_scales(mag.amax(dim=(1, 3)))
    # |x| / s is |x / s| (a division rounds symmetrically), so the magnitudes feed the rounding.
    q = round_to_e4m3_magnitude((mag / scale[:, None, :, None]).clamp_max_(FP8_MAX)).copysign_(blocks)
    q = q.view(rows + pr, cols + pc)
    return (q[:rows, :cols].contiguous() if pr or pc else q), scale


def dequantize_fp8_blockwise_fp32(values: torch.Tensor, scale: torch.Tensor,
                                  block: tuple[int, int]) -> torch.Tensor:
    """`quant.dequantize_fp8_blockwise(..., dtype=float32)` of e4m3 values held in fp32."""
    rows, cols = values.shape
    br, bc = _fitted_block(values.shape, block)
    if rows % br or cols % bc:
        full = scale.repeat_interleave(bc, dim=1)[:, :cols]
        if br > 1:
            full = full.repeat_interleave(br, dim=0)[:rows]
        return values * full
    tiles = values.view(rows // br, br, cols // bc, bc)
    return (tiles * scale[:, None, :, None]).view(rows, cols)
