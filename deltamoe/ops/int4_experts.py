"""Routed INT4 (W4A16) experts on torch's CPU int4 kernel, with few kernel calls per layer.

Each expert's gate (w1) and up (w3) projections are converted as one [2I, D] operand, so an
expert runs in two kernel calls (gate|up, down) instead of three: `int4_expert_mlp`.

A decode step of one token sends that token to k experts that all read the same row. The
kernel's operand is blocked by output rows (`kernel_block_rows` rows a block, each block
K-major), so the k experts' operands can be joined without converting anything again:

- gate|up: the k [2I, D] operands stacked along the output dim are one [k*2I, D] operand;
- down: the k [D, I] operands joined along the input dim, block by block, are one [D, k*I]
  operand, fed the k hidden rows side by side, each already scaled by its routing weight.

`int4_experts_one_token` so runs the whole top-k in two kernel calls. The routed sum then
happens inside the kernel's fp32 accumulation and is rounded to bf16 once, where the
expert-by-expert form rounds each expert output to bf16 before the fp32 sum (and rounds
the weighted hidden rows to bf16 for the kernel): the two agree to bf16 rounding, and both
are held to `experts_forward_reference` on the dequantised weights.
"""

from __future__ import annotations

import functools

import torch

from deltamoe.ops.activations import glu
from deltamoe.ops.int4_matmul import has_int4_cpu_kernel, int4_kernel_weight, int4_matmul

# Down-projection operands are padded to this many output rows so that every block size a
# build uses (64 on AVX-512, 32 on AVX2 and the scalar path) divides them.
STACK_ROW_MULTIPLE = 64


def _convert(codes: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)


@functools.cache
def kernel_block_rows() -> int | None:
    """Rows per block of the CPU int4 kernel's weight layout, when that layout is [N/B, K, B/2]
    (each block of B output rows stored K-major), which `int4_experts_one_token` relies on.

    The layout is private to the torch build, so it is read off a probe: converting two code
    matrices stacked along N must give the two conversions back to back, and converting them
    joined along K must give their blocks interleaved. None when no block size explains the
    probe (or the kernel is missing): then experts run one at a time.
    """
    if not has_int4_cpu_kernel():
        return None
    gen = torch.Generator().manual_seed(0)
    n, k = 128, 64
    a, b = (torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32) for _ in range(2))
    pa, pb = _convert(a), _convert(b)
    if not torch.equal(_convert(torch.cat([a, b])), torch.cat([pa, pb])):
        return None
    joined_k = _convert(torch.cat([a, b], dim=1))
    for rows in (64, 32, 16):
        blocks = torch.cat([pa.reshape(n // rows, k, rows // 2), pb.reshape(n // rows, k, rows // 2)], dim=1)
        if torch.equal(blocks.reshape(joined_k.shape), joined_k):
            return rows
    return None


def gate_up_operand(w1: tuple[torch.Tensor, torch.Tensor], w3: tuple[torch.Tensor, torch.Tensor],
                    group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed u8 [I, D/2], bf16 scale [I, D/g]) of w1 and of w3 -> the kernel operand of the
    [2I, D] matrix [w1; w3] (weight, scales_and_zeros [D/g, 2I, 2])."""
    return int4_kernel_weight(torch.cat([w1[0], w3[0]]), torch.cat([w1[1], w3[1]]), group_size,
                              row_multiple=STACK_ROW_MULTIPLE)


def down_operand(w2: tuple[torch.Tensor, torch.Tensor], group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed u8 [D, I/2], bf16 scale [D, I/g]) -> the kernel operand, rows padded to `STACK_ROW_MULTIPLE`."""
    return int4_kernel_weight(w2[0], w2[1], group_size, row_multiple=STACK_ROW_MULTIPLE)


def int4_expert_mlp(x: torch.Tensor, w13: torch.Tensor, sz13: torch.Tensor, w2: torch.Tensor, sz2: torch.Tensor,
                    intermediate: int, out_features: int, group_size: int, act: str, situ_beta: float = 4.0,
                    situ_linear_beta: float = 25.0) -> torch.Tensor:
    """One expert on its rows x [n, D] -> [n, D] in x.dtype: `down(glu(gate(x), up(x)))` with
    gate|up one kernel call on the operand of `gate_up_operand`."""
    gate_up = int4_matmul(x, w13, sz13, w13.shape[0], group_size)
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:2 * intermediate]
    return int4_matmul(glu(gate, up, act, situ_beta, situ_linear_beta), w2, sz2, out_features, group_size)


def int4_experts_one_token(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, w13: torch.Tensor,
                           sz13: torch.Tensor, w2: torch.Tensor, sz2: torch.Tensor, intermediate: int,
                           out_features: int, group_size: int, block_rows: int, act: str,
                           situ_beta: float = 4.0, situ_linear_beta: float = 25.0) -> torch.Tensor:
    """The weighted sum of one token's k experts in two kernel calls -> fp32 [1, D].

    x [1, D]; weights, indices [1, k]. The stacks hold every expert's operands:
    w13 u8 [E, 2I', D/2] with sz13 [E, D/g, 2I', 2] (from `gate_up_operand`), w2 u8 [E, D', I/2]
    with sz2 [E, I/g, D', 2] (from `down_operand`; D' >= D rows, a multiple of `block_rows`).
    Only the k selected experts' operands are read (gathered into one operand each).
    """
    # index_select, not advanced indexing: it copies whole rows (several times faster on u8).
    idx = indices[0]
    k, rows13 = idx.numel(), w13.shape[1]
    gate_up_w = w13.index_select(0, idx).reshape(k * rows13, w13.shape[2])
    gate_up_sz = sz13.index_select(0, idx).transpose(0, 1).reshape(sz13.shape[1], k * rows13, 2)
    xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
    gate_up = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), gate_up_w, group_size, gate_up_sz)
    gate_up = gate_up.view(k, rows13).float()
    hidden = glu(gate_up[:, :intermediate], gate_up[:, intermediate:2 * intermediate], act, situ_beta,
                 situ_linear_beta)
    hidden = (hidden * weights[0].float().unsqueeze(-1)).to(torch.bfloat16).reshape(1, k * intermediate)
    e, d_rows, half_i = w2.shape
    blocks = w2.index_select(0, idx).view(k, d_rows // block_rows, 2 * half_i, block_rows // 2)
    down_w = blocks.transpose(0, 1).reshape(d_rows, k * half_i)  # [D'/B, k, I, B/2]: blocks joined along K
    down_sz = sz2.index_select(0, idx).reshape(k * sz2.shape[1], d_rows, 2)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(hidden, down_w, group_size, down_sz)
    return y[:, :out_features].float()
