"""Weight (de)quantisation formats of the Kimi checkpoints (spec §6), as plain torch.

- MXFP4 (OCP microscaling, compressed-tensors `mxfp4-pack-quantized`): the native K3
  routed-expert format.
- INT4 group-128 symmetric with bf16 scales: the community W4A8 checkpoints' experts.
- FP8-E4M3 blockwise (DeepSeek-V3 style): 128x128 weight blocks, 1x128 activation groups.

Everything here is a readable reference that dequantises to a float tensor; CPU has no
4-bit or fp8 GEMM, and a GPU kernel must match these functions.
"""

from __future__ import annotations

import torch

# ---------------------------------------------------------------------------- MXFP4

MXFP4_GROUP = 32
# E2M1 magnitudes by 3-bit code (exponent bits 2, mantissa bit 1); bit 0x8 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E8M0_BIAS = 127


def _e2m1_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """All 16 codes -> value: codes 0..7 positive, 8..15 the same magnitudes negated."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags]).to(dtype)


def _check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{name}: expected shape {expected}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """u8 [..., C/2] -> u8 codes [..., C]; the low nibble is the even (first) element."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """u8 codes 0..15 [..., C] (C even) -> u8 [..., C/2], first element in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def dequantize_mxfp4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """MXFP4 -> float: w[r, c] = e2m1(code[r, c]) * 2^(weight_scale[r, c // 32] - 127).

    weight_packed: u8 [R, C/2]; weight_scale: u8 [R, C/32] (E8M0, no global scale).
    The product is exact in fp32; the cast to `dtype` is exact for bf16 too unless the
    scale exponent leaves bf16's range (it shares fp32's exponent range, so it never does).
    """
    if weight_packed.dim() != 2 or weight_packed.dtype != torch.uint8:
        raise ValueError(f"weight_packed: expected uint8 [R, C/2], got {weight_packed.dtype} {tuple(weight_packed.shape)}")
    rows, half_cols = weight_packed.shape
    cols = 2 * half_cols
    if cols % MXFP4_GROUP != 0:
        raise ValueError(f"weight_packed: expected C/2 with C a multiple of {MXFP4_GROUP}, got C/2 = {half_cols}")
    _check_shape("weight_scale", weight_scale, (rows, cols // MXFP4_GROUP), torch.uint8)
    values = _e2m1_table(torch.float32, weight_packed.device)[unpack_nibbles(weight_packed).long()]
    # 2^(s-127) via ldexp: exact for every s in 0..254 (s = 255 is NaN in E8M0; not produced).
    scale = torch.ldexp(torch.ones_like(weight_scale, dtype=torch.float32), weight_scale.int() - E8M0_BIAS)
    w = values.view(rows, -1, MXFP4_GROUP) * scale.unsqueeze(-1)
    return w.view(rows, cols).to(dtype)


_BYTE_PAIRS: dict[torch.device, torch.Tensor] = {}  # per device: [256] int32, two bf16 values a byte
_E8M0_BF16: dict[torch.device, torch.Tensor] = {}  # per device: [256] bf16, 2^(s-127)


def dequantize_mxfp4_bf16(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """`dequantize_mxfp4(..., dtype=bf16)` in two passes, for experts dequantised at every use.

    Each byte indexes a table of its two decoded bf16 values (stored as one int32, so the gather
    writes both elements in place), then each group of 32 is multiplied by its bf16 power of two.
    Both steps are exact in bf16 (an e2m1 value has 2 significant bits and the scale is a power
    of two), so the result equals the reference bit for bit; tests hold it to that.
    """
    device = weight_packed.device
    if device not in _BYTE_PAIRS:
        byte = torch.arange(256, device=device)
        table = _e2m1_table(torch.bfloat16, device)
        pairs = torch.stack([table[byte & 0x0F], table[byte >> 4]], dim=-1)  # little-endian: low nibble first
        _BYTE_PAIRS[device] = pairs.contiguous().view(torch.int32).reshape(256)
        _E8M0_BF16[device] = torch.ldexp(torch.ones(256, device=device), byte - E8M0_BIAS).to(torch.bfloat16)
    rows, half_cols = weight_packed.shape
    values = _BYTE_PAIRS[device][weight_packed.int()].view(torch.bfloat16)  # [R, C]
    scale = _E8M0_BF16[device][weight_scale.int()]  # [R, C/32]
    return (values.view(rows, -1, MXFP4_GROUP) * scale.unsqueeze(-1)).view(rows, 2 * half_cols)


def _round_to_e2m1_code(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (ties to the even code, as OCP rounding), saturating at +-6."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    mids = (mags[1:] + mags[:-1]) / 2  # 7 decision boundaries
    a = x.abs().clamp(max=E2M1_MAX)
    code = torch.bucketize(a, mids)  # a == mids[i] -> i (the lower neighbour)
    tie = a == mids[code.clamp(max=len(mids) - 1)]
    code = torch.where(tie & (code % 2 == 1), code + 1, code)
    sign = (x < 0) & (code > 0)  # never emit -0 so a zero packs to 0x0
    return (code + 8 * sign.long()).to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [R, C] (C a multiple of 32) -> (weight_packed u8 [R, C/2], weight_scale u8 [R, C/32]).

    Each 32-group's scale is the smallest power of two 2^e with max|w| / 2^e <= 6, so the
    group maximum is never clipped (OCP's floor(log2 max) - 2 rule can clip it to 6).
    Values that are already e2m1 * 2^e round-trip exactly.
    """
    if w.dim() != 2 or w.shape[1] % MXFP4_GROUP != 0:
        raise ValueError(f"w: expected [R, C] with C a multiple of {MXFP4_GROUP}, got {tuple(w.shape)}")
    rows, cols = w.shape
    groups = w.float().view(rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1)
    # frexp: amax/6 = m * 2^p with m in [0.5, 1); ceil(log2) is p, or p-1 for an exact power.
    mant, exp = torch.frexp(amax / E2M1_MAX)
    exp = torch.where(mant == 0.5, exp - 1, exp)
    exp = torch.where(amax == 0, -E8M0_BIAS, exp).clamp(-E8M0_BIAS, E8M0_BIAS)
    codes = _round_to_e2m1_code(torch.ldexp(groups, -exp.unsqueeze(-1)))
    return pack_nibbles(codes.view(rows, cols)), (exp + E8M0_BIAS).to(torch.uint8)


# ----------------------------------------------------------------------------- INT4

INT4_GROUP = 128


def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 per group: float [R, C] -> (packed u8 [R, C/2], scale bf16 [R, C/group_size]).

    Packing: each value q in -8..7 is stored as its two's-complement nibble (q & 0xF), two
    per byte, the first (even) element in the low nibble, like MXFP4 above. scale =
    bf16(max|w| / 7); quantising with the already-rounded bf16 scale means dequantise
    reproduces the stored value exactly. (Checkpoints that pack eight nibbles into int32
    with a +8 offset are a different byte layout of the same numbers.)
    """
    if w.dim() != 2 or w.shape[1] % group_size != 0 or w.shape[1] % 2 != 0:
        raise ValueError(f"w: expected [R, C] with C a multiple of group_size={group_size}, got {tuple(w.shape)}")
    rows, cols = w.shape
    groups = w.float().view(rows, cols // group_size, group_size)
    scale = (groups.abs().amax(dim=-1) / 7).to(torch.bfloat16)
    safe = scale.float().masked_fill(scale == 0, 1.0).unsqueeze(-1)
    q = torch.round(groups / safe).clamp(-8, 7).to(torch.int8)
    return pack_nibbles((q & 0x0F).view(rows, cols)), scale


def dequantize_int4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    group_size: int = INT4_GROUP,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Inverse of `quantize_int4`: w[r, c] = q[r, c] * scale[r, c // group_size]."""
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"packed: expected uint8 [R, C/2], got {packed.dtype} {tuple(packed.shape)}")
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    if cols % group_size != 0:
        raise ValueError(f"packed: expected C = 2*{packed.shape[1]} to be a multiple of group_size={group_size}")
    _check_shape("scale", scale, (rows, cols // group_size), torch.bfloat16)
    nibbles = unpack_nibbles(packed).to(torch.int16)
    q = torch.where(nibbles >= 8, nibbles - 16, nibbles).float()  # sign-extend the nibble
    w = q.view(rows, -1, group_size) * scale.float().unsqueeze(-1)
    return w.view(rows, cols).to(dtype)


# ------------------------------------------------------------------ FP8 blockwise

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
FP8_BLOCK = (128, 128)
# Floor on a block's absmax so an all-zero block gets a finite scale (its values stay 0).
_AMAX_FLOOR = 1e-12


def _block_scales(amax: torch.Tensor) -> torch.Tensor:
    return amax.clamp_min(_AMAX_FLOOR) / FP8_MAX


def quantize_fp8_blockwise(
    w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """float [R, C] -> (e4m3 [R, C], fp32 scale [ceil(R/br), ceil(C/bc)]), w ~= fp8 * scale.

    The scale is the DeepSeek-V3 `weight_scale_inv`: max|block| / 448, multiplied back on
    dequantisation. Edge blocks of a shape that is not a multiple of the block are partial.
    """
    if w.dim() != 2:
        raise ValueError(f"w: expected [R, C], got shape {tuple(w.shape)}")
    br, bc = block
    rows, cols = w.shape
    pr, pc = -rows % br, -cols % bc
    padded = torch.nn.functional.pad(w.float(), (0, pc, 0, pr))
    blocks = padded.view((rows + pr) // br, br, (cols + pc) // bc, bc)
    scale = _block_scales(blocks.abs().amax(dim=(1, 3)))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows + pr, cols + pc)[:rows, :cols].contiguous(), scale


def dequantize_fp8_blockwise(
    w_fp8: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Inverse of `quantize_fp8_blockwise`: each element times its block's scale."""
    if w_fp8.dim() != 2:
        raise ValueError(f"w_fp8: expected [R, C], got shape {tuple(w_fp8.shape)}")
    br, bc = block
    rows, cols = w_fp8.shape
    _check_shape("scale", scale, (-(-rows // br), -(-cols // bc)), torch.float32)
    full = scale.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]
    return (w_fp8.float() * full).to(dtype)


def quantize_fp8_act(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations in 1 x `group` tiles along the last dim: [..., K] -> (e4m3 [..., K],
    fp32 scale [..., K/group]). K must be a multiple of `group` (hidden sizes are)."""
    if x.shape[-1] % group != 0:
        raise ValueError(f"x: expected last dim a multiple of group={group}, got {tuple(x.shape)}")
    tiles = x.float().unflatten(-1, (x.shape[-1] // group, group))
    scale = _block_scales(tiles.abs().amax(dim=-1))
    q = (tiles / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.flatten(-2), scale


def dequantize_fp8_act(x_fp8: torch.Tensor, scale: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Inverse of `quantize_fp8_act`, in fp32."""
    _check_shape("scale", scale, (*x_fp8.shape[:-1], x_fp8.shape[-1] // group), torch.float32)
    tiles = x_fp8.float().unflatten(-1, (x_fp8.shape[-1] // group, group))
    return (tiles * scale.unsqueeze(-1)).flatten(-2)


def fp8_blockwise_matmul_reference(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    x_scale: torch.Tensor | None = None,
    block: tuple[int, int] = FP8_BLOCK,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y = x @ W^T with W stored blockwise-fp8, by dequantising both sides to fp32.

    x is either a float activation (used as is: W8A16) or an e4m3 tensor from
    `quantize_fp8_act` together with its `x_scale` (W8A8, the DeepSeek-V3 recipe). The
    fp32 accumulation is what an fp8 tensor-core GEMM with per-block scaling computes, up
    to summation order. The result is in `out_dtype` (default: bf16 for fp8 x, else x.dtype).
    """
    if x.dtype == FP8_DTYPE:
        if x_scale is None:
            raise ValueError("x_scale: required when x is float8_e4m3fn")
        x_full = dequantize_fp8_act(x, x_scale, group=block[1])
        out_dtype = out_dtype or torch.bfloat16
    else:
        x_full = x.float()
        out_dtype = out_dtype or x.dtype
    w_full = dequantize_fp8_blockwise(w_fp8, w_scale, block, dtype=torch.float32)
    return (x_full @ w_full.T).to(out_dtype)


# ------------------------------------------------------------------- bytes / param

# Stored bytes per weight, scales included (spec §6): the planner's memory arithmetic.
BYTES_PER_PARAM = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp8": 1.0,  # per-tensor scale; 128x128 block scales add 4/16384 more
    "mxfp4": 0.5 + 1 / 32,  # 4-bit code + one E8M0 byte per 32
    "nvfp4": 0.5 + 1 / 16,  # 4-bit code + one fp8 scale per 16 (+ a per-tensor fp32)
    "int4_g128": 0.5 + 2 / 128,  # 4-bit code + one bf16 scale per 128
    "int4": 0.5,  # bare 4-bit, scales ignored
}


def bytes_per_param(fmt: str) -> float:
    """Bytes per parameter of a storage format, e.g. "mxfp4" -> 0.53125."""
    try:
        return BYTES_PER_PARAM[fmt]
    except KeyError:
        raise ValueError(f"fmt: expected one of {sorted(BYTES_PER_PARAM)}, got {fmt!r}") from None
