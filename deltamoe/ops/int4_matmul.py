"""INT4 weight matmuls on the CPU: int4 weight-only (W4A16) and W4A8, each with its reference.

The weights are symmetric INT4 per group along the input dim (`ops.quant.quantize_int4`:
u8 [N, K/2], two's-complement nibbles, the even element in the low nibble; bf16 scale
[N, K/group]). The fast forms run torch's own CPU kernels:

- `int4_matmul`: `aten._weight_int4pack_mm_for_cpu` on the layout that
  `aten._convert_weight_to_int4pack_for_cpu` makes (`int4_kernel_weight`). Its vectorised
  path takes bf16 activations; fp32 activations fall to a scalar loop ~30x slower, so the
  activations are cast to bf16 for it (the W4A16 contract) and the result is cast back.
  One row (a batch-1 decode step) runs our own kernel on the same operand instead
  (`ops.int4_matvec`, same contract), where it is built.
- `w4a8_int8_matmul`: `aten._dyn_quant_matmul_4bit`, which quantises each activation row to
  int8 (asymmetric, one scale and zero point per row) and accumulates the int8 x int4
  products per group. Arm builds run KleidiAI kernels; x86 builds run ATen's scalar loop.
- `w4a8_fp8_matmul`: each activation row rounded to FP8-E4M3 with one scale, then the
  int4 kernel above. An e4m3 value is exact in bf16, so the kernel sees exactly the fp8
  activations; the row scale is applied to the output.

Each has a `*_reference` that dequantises the weight with `dequantize_int4` and does a
plain fp32 matmul, rounding where the kernel's contract rounds; the tests hold the fast
forms to them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltamoe.ops import int4_matvec
from deltamoe.ops.quant import FP8_DTYPE, FP8_MAX, INT4_GROUP, dequantize_int4, unpack_nibbles

# The kernel reads unsigned nibbles q + 8 (its dequantisation is (u - 8) * scale + zero).
_INT4_OFFSET = 8
_KERNEL_N_MULTIPLE = 16  # the converter's rule for the output dim
INT4_KERNEL_GROUPS = (32, 64, 128, 256)  # group sizes the CPU kernel accepts


def has_int4_cpu_kernel() -> bool:
    """Whether this torch build has the CPU int4 weight-only matmul."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def has_w4a8_int8_kernel() -> bool:
    """Whether this torch build has the dynamic int8-activation x int4-weight matmul."""
    return hasattr(torch.ops.aten, "_dyn_quant_matmul_4bit") and hasattr(torch.ops.aten, "_dyn_quant_pack_4bit_weight")


def _signed_codes(packed: torch.Tensor) -> torch.Tensor:
    """u8 [N, K/2] nibbles -> int32 [N, K] values in -8..7."""
    nibbles = unpack_nibbles(packed).to(torch.int32)
    return torch.where(nibbles >= 8, nibbles - 16, nibbles)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


# ------------------------------------------------------------------ int4 weight-only


def int4_kernel_weight(packed: torch.Tensor, scale: torch.Tensor, group_size: int = INT4_GROUP,
                       row_multiple: int = _KERNEL_N_MULTIPLE) -> tuple[torch.Tensor, torch.Tensor]:
    """(u8 [N, K/2], bf16 [N, K/g]) -> (the CPU kernel's u8 weight, bf16 scales_and_zeros [K/g, N, 2]).

    The kernel's byte layout is private to torch's CPU build (blocked by output rows), so it
    is produced by torch's own converter from the unsigned codes; zero is 0 (symmetric). The
    converter wants N a multiple of 16 (`row_multiple`, a multiple of 16, rounds further): extra
    rows get zero scales (their outputs are 0) and `int4_matmul` drops them.
    """
    if group_size not in INT4_KERNEL_GROUPS:
        raise ValueError(f"group_size: the CPU int4 kernel takes {INT4_KERNEL_GROUPS}, got {group_size}")
    if row_multiple % _KERNEL_N_MULTIPLE:
        raise ValueError(f"row_multiple: expected a multiple of {_KERNEL_N_MULTIPLE}, got {row_multiple}")
    pad = -packed.shape[0] % row_multiple
    codes = F.pad(_signed_codes(packed), (0, 0, 0, pad)) + _INT4_OFFSET
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
    scales = F.pad(scale.to(torch.bfloat16), (0, 0, 0, pad)).t()
    scales_and_zeros = torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous()
    return weight, scales_and_zeros


def int4_matmul(x: torch.Tensor, weight: torch.Tensor, scales_and_zeros: torch.Tensor, out_features: int,
                group_size: int = INT4_GROUP) -> torch.Tensor:
    """x [..., K] @ W^T with W in the kernel layout of `int4_kernel_weight` -> [..., N] in x.dtype."""
    # Each step is skipped when it would be a no-op: a decode step calls this hundreds of times.
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if flat.dtype != torch.bfloat16:
        flat = flat.to(torch.bfloat16)
    block = int4_matvec.one_row_block()
    # The one-row kernel reads whole blocks (the model's operands are padded to them).
    if flat.shape[0] == 1 and block and weight.shape[0] % block == 0:
        y = int4_matvec.matvec(flat, weight, scales_and_zeros, out_features, block, group_size).to(torch.bfloat16)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), weight, group_size, scales_and_zeros)
    if y.shape[1] != out_features:
        y = y[:, :out_features]
    if x.dtype != torch.bfloat16:
        y = y.to(x.dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], out_features)


def dequantized_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                       group_size: int = INT4_GROUP) -> torch.Tensor:
    """x @ dequantize_int4(packed, scale)^T, all in fp32."""
    return x.float() @ dequantize_int4(packed, scale, group_size, dtype=torch.float32).t()


def int4_matmul_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                          group_size: int = INT4_GROUP) -> torch.Tensor:
    """The readable form of `int4_matmul`, with its contract: bf16 activations in, fp32
    accumulation against the dequantised weight, bf16 out, returned in x.dtype."""
    return dequantized_matmul(x.bfloat16(), packed, scale, group_size).bfloat16().to(x.dtype)


# ----------------------------------------------------------------------------- W4A8


def int8_act_asymmetric(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row asymmetric int8 of the activations, as `_dyn_quant_matmul_4bit` quantises them:
    the row range (widened to include 0) over 255 steps, zero point placing the row minimum at -128.
    Returns (q in -128..127 as fp32, scale [M, 1], zero point [M, 1])."""
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / 255
    safe = scale.masked_fill(scale == 0, 1.0)
    zero = torch.round(-128 - lo / safe).clamp(-128, 127)
    q = (torch.round(x / safe) + zero).clamp(-128, 127)
    return q, safe, zero


def w4a8_int8_weight(packed: torch.Tensor, scale: torch.Tensor, group_size: int = INT4_GROUP) -> torch.Tensor:
    """(u8 [N, K/2], bf16 [N, K/g]) -> the packed operand of `_dyn_quant_matmul_4bit` (one flat tensor
    holding codes and fp32 scales; on Arm, KleidiAI's blocked layout)."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    codes = (_signed_codes(packed) + _INT4_OFFSET).to(torch.uint8)
    unsigned = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return torch.ops.aten._dyn_quant_pack_4bit_weight(unsigned.contiguous(), scale.float().reshape(-1).contiguous(),
                                                      None, group_size, k, n)


def w4a8_int8_matmul(x: torch.Tensor, weight: torch.Tensor, in_features: int, out_features: int,
                     group_size: int = INT4_GROUP) -> torch.Tensor:
    """x [..., K] with per-row dynamic int8 activations @ int4 W^T -> [..., N] in x.dtype."""
    y = torch.ops.aten._dyn_quant_matmul_4bit(_flat(x).float(), weight, group_size, in_features, out_features)
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


def w4a8_int8_matmul_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                               group_size: int = INT4_GROUP) -> torch.Tensor:
    """`w4a8_int8_matmul` written out: int8 activations dequantised, times the dequantised weight, in fp32."""
    q, s, z = int8_act_asymmetric(x.float())
    return dequantized_matmul((q - z) * s, packed, scale, group_size).to(x.dtype)


def fp8_act_per_row(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x scaled so its max is 448 and rounded to e4m3 -> (e4m3 values as fp32, scale [..., 1]).
    `amax` [..., 1]: the rows' absolute maxima when x is a slice of them (a row-parallel shard's input)."""
    if amax is None:
        amax = x.float().abs().amax(-1, keepdim=True)
    scale = amax.clamp_min(1e-12) / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    return q, scale


def w4a8_fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scales_and_zeros: torch.Tensor, out_features: int,
                    group_size: int = INT4_GROUP, amax: torch.Tensor | None = None) -> torch.Tensor:
    """Dynamic per-row FP8-E4M3 activations @ int4 W^T through the int4 kernel -> [..., N] in x.dtype
    (`amax`: see `fp8_act_per_row`)."""
    q, scale = fp8_act_per_row(x, amax)
    return (int4_matmul(q, weight, scales_and_zeros, out_features, group_size) * scale).to(x.dtype)


def w4a8_fp8_matmul_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                              group_size: int = INT4_GROUP, amax: torch.Tensor | None = None) -> torch.Tensor:
    """`w4a8_fp8_matmul` written out in fp32."""
    q, s = fp8_act_per_row(x, amax)
    return (int4_matmul_reference(q, packed, scale, group_size) * s).to(x.dtype)
