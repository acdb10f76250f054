"""Routed INT4 (W4A16) experts on torch's CPU int4 kernel, with few kernel calls per layer.

Each expert's gate (w1) and up (w3) projections are converted as one [2I, D] operand, so an
expert runs in two kernel calls (gate|up, down) instead of three: `int4_expert_mlp`.

A decode step of one token sends that token to k experts that all read the same row. The
kernel's operand is blocked by output rows (`kernel_block_rows` rows a block, each block
K-major), so the k experts' operands can be joined without converting anything again:

- gate|up: the k [2I, D] operands stacked along the output dim are one [k*2I, D] operand;
- down: the k [D, I] operands joined along the input dim, block by block, are one [D, k*I]
  operand, fed the k hidden rows side by side, each already scaled by its routing weight.

`int4_experts_one_token` so runs the whole top-k in two kernel calls; `int4_experts_static` is the
form of any batch whose shapes never depend on the routing (what a compiled decode graph holds). The stack keeps every
operand in the order the gather wants (`ExpertOperands`), so gathering k experts copies whole
contiguous runs (no transposing copy on the decode path): gate|up weights expert-major
[E, 2I, D/2]; their scales group-major [D/g, E, 2I, 2]; down weights block-major
[D'/B, E, I, B/2]; their scales expert-major [E, I/g, D', 2]. The routed sum then
happens inside the kernel's fp32 accumulation and is rounded to bf16 once, where the
expert-by-expert form rounds each expert output to bf16 before the fp32 sum (and rounds
the weighted hidden rows to bf16 for the kernel): the two agree to bf16 rounding, and both
are held to `experts_forward_reference` on the dequantised weights.

In a compiled decode graph a few rows need no gather at all: `int4_experts_in_place` reads the
selected experts' operands where they lie in the stack, the expert index turned into indirect
indexing inside Inductor's generated dequantise-and-reduce loops (`kernel_codes` is the readable
form of the layout it reads). There it replaces the gather and both kernel calls
(bench/int4_matvec_forms.py measures the forms).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from deltamoe.ops import int4_matvec
from deltamoe.ops.activations import glu
from deltamoe.ops.int4_matmul import has_int4_cpu_kernel, int4_kernel_weight, int4_matmul
from deltamoe.ops.moe import gathers_expert_weights
from deltamoe.ops.packed_experts import experts_forward_by_expert

# Down-projection operands are padded to this many output rows so that every block size a
# build uses (64 on AVX-512, 32 on AVX2 and the scalar path) divides them.
STACK_ROW_MULTIPLE = 64


# `ops.moe.ALL_EXPERTS_EXTRA_MACS_PER_EXPERT` for int4 stacks, per torch thread: the all-experts
# form's two kernel calls spread over the threads, the expert-by-expert loop's many small ones
# hardly do. Measured 2026-12-04 on an AVX-512 EPYC (`int4_experts_static` vs `int4_experts_by_expert`,
# eager): 64 experts of 256 x 256, top-8 (`small`), one thread: all 4.9 /
# 10.1 / 20.1 / 38.1 ms against the loop's 7.5 / 10.4 / 12.1 / 10.5 ms at 8 / 16 / 32 / 64 rows
# (1.4 / 2.8 / 5.5 / 11 M extra an expert); two threads: all 4.5 / 8.7 / 12.3 / 16.7 ms against
# 7.0 / 9.9 / 11.2 / 14.3 ms at 16 / 32 / 48 / 64 rows (the switch near 7 M); 16 experts of
# 128 x 128, top-4, two threads: all faster up to 64 rows (2.4 M), even at 128 (4.7 M). In the
# compiled engine (`small`, two threads, 32 new tokens a request, `bench/int4_expert_forms.py`)
# the loop ran batch 16 at 0.73x the all-experts form and batch 64 at 1.10-1.24x.
ALL_EXPERTS_EXTRA_MACS_PER_EXPERT_PER_THREAD = 3 * 1024 * 1024


def all_experts_budget() -> int:
    """The int4 stacks' all-experts budget at this process's torch thread count (read outside a
    graph: the compiled dispatcher binds it when it is installed)."""
    return ALL_EXPERTS_EXTRA_MACS_PER_EXPERT_PER_THREAD * torch.get_num_threads()


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


@dataclass(frozen=True)
class ExpertOperands:
    """Every expert's kernel operands of one layer, stacked in the gather order (module docstring).

    w13 u8 [E, 2I', D/2], sz13 bf16 [D/g, E, 2I', 2] (from `gate_up_operand`); w2 u8
    [D'/B, E, I, B/2], sz2 bf16 [E, I/g, D', 2] (from `down_operand`; B = `block_rows`, D' a
    multiple of it). `block_rows=None` (the layout is unknown) keeps each down operand whole (B = D').
    """
    w13: torch.Tensor
    sz13: torch.Tensor
    w2: torch.Tensor
    sz2: torch.Tensor

    @staticmethod
    def empty(num_experts: int, gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor],
              block_rows: int | None) -> "ExpertOperands":
        """Room for `num_experts` experts shaped like one expert's `gate_up` and `down` operands."""
        (w13, sz13), (w2, sz2) = gate_up, down
        rows, k_in = w2.shape[0], 2 * w2.shape[1]  # down: [D', I/2] u8 -> blocks of [I, B/2]
        block = block_rows or rows
        return ExpertOperands(w13.new_empty(num_experts, *w13.shape),
                              sz13.new_empty(sz13.shape[0], num_experts, *sz13.shape[1:]),
                              w2.new_empty(rows // block, num_experts, k_in, block // 2),
                              sz2.new_empty(num_experts, *sz2.shape))

    def put(self, expert: int, gate_up: tuple[torch.Tensor, torch.Tensor],
            down: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Store one expert's operands (as `gate_up_operand` and `down_operand` return them)."""
        self.w13[expert], self.sz13[:, expert] = gate_up
        self.w2[:, expert] = down[0].view(self.w2.shape[0], *self.w2.shape[2:])
        self.sz2[expert] = down[1]

    @staticmethod
    def stack(gate_up: list[tuple[torch.Tensor, torch.Tensor]], down: list[tuple[torch.Tensor, torch.Tensor]],
              block_rows: int | None) -> "ExpertOperands":
        ops = ExpertOperands.empty(len(gate_up), gate_up[0], down[0], block_rows)
        for expert, (g, d) in enumerate(zip(gate_up, down)):
            ops.put(expert, g, d)
        return ops

    def expert(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One expert's (w13, sz13, w2, sz2) as the kernel takes them (contiguous)."""
        blocks, _, k, half_b = self.w2.shape
        return (self.w13[expert], self.sz13[:, expert].contiguous(),
                self.w2[:, expert].reshape(blocks * 2 * half_b, k // 2), self.sz2[expert])

    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.sz13, self.w2, self.sz2))


def int4_expert_mlp(x: torch.Tensor, w13: torch.Tensor, sz13: torch.Tensor, w2: torch.Tensor, sz2: torch.Tensor,
                    intermediate: int, out_features: int, group_size: int, act: str, situ_beta: float = 4.0,
                    situ_linear_beta: float = 25.0) -> torch.Tensor:
    """One expert on its rows x [n, D] -> [n, D] in x.dtype: `down(glu(gate(x), up(x)))` with
    gate|up one kernel call on the operand of `gate_up_operand`."""
    gate_up = int4_matmul(x, w13, sz13, w13.shape[0], group_size)
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:2 * intermediate]
    return int4_matmul(glu(gate, up, act, situ_beta, situ_linear_beta), w2, sz2, out_features, group_size)


def int4_experts_by_expert(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, ops: ExpertOperands,
                           intermediate: int, out_features: int, group_size: int, act: str,
                           situ_beta: float = 4.0, situ_linear_beta: float = 25.0) -> torch.Tensor:
    """The weighted sum of each row's k experts, expert by expert: each expert that received rows
    runs `int4_expert_mlp` (two kernel calls) on them -> fp32 [N, D] (fp64 for fp64 x). Row counts
    per expert are read back to the host (`experts_forward_by_expert`): eager code, or one opaque
    op in a graph (`ops.sorted_experts_op.int4_sorted_experts`)."""
    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        return int4_expert_mlp(rows, *ops.expert(expert), intermediate, out_features, group_size, act, situ_beta,
                               situ_linear_beta)

    return experts_forward_by_expert(x, weights, indices, ops.w13.shape[0], expert_mlp)


def int4_experts_one_token(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, ops: ExpertOperands,
                           intermediate: int, out_features: int, group_size: int, act: str,
                           situ_beta: float = 4.0, situ_linear_beta: float = 25.0) -> torch.Tensor:
    """The weighted sum of one token's k experts in two kernel calls -> fp32 [1, D].

    x [1, D]; weights, indices [1, k]; `ops` stacked with the block size `kernel_block_rows`
    reports. Only the k selected experts' operands are read (gathered into one operand each).
    """
    if int4_matvec.one_row_block():
        return int4_experts_by_matvec(x, weights, indices, ops, intermediate, out_features, act, situ_beta,
                                      situ_linear_beta)
    # index_select, not advanced indexing: it copies whole rows (several times faster on u8).
    idx = indices[0]
    k, rows13 = idx.numel(), ops.w13.shape[1]
    gate_up_w = ops.w13.index_select(0, idx).reshape(k * rows13, ops.w13.shape[2])
    gate_up_sz = ops.sz13.index_select(1, idx).reshape(ops.sz13.shape[0], k * rows13, 2)
    xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
    gate_up = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), gate_up_w, group_size, gate_up_sz)
    gate_up = gate_up.view(k, rows13).float()
    hidden = glu(gate_up[:, :intermediate], gate_up[:, intermediate:2 * intermediate], act, situ_beta,
                 situ_linear_beta)
    hidden = (hidden * weights[0].float().unsqueeze(-1)).to(torch.bfloat16).reshape(1, k * intermediate)
    blocks, _, k_in, half_b = ops.w2.shape
    down_w = ops.w2.index_select(1, idx).reshape(blocks * 2 * half_b, k * k_in // 2)  # blocks joined along K
    down_sz = ops.sz2.index_select(0, idx).reshape(k * ops.sz2.shape[1], ops.sz2.shape[2], 2)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(hidden, down_w, group_size, down_sz)
    return y[:, :out_features].float()


@functools.cache
def kernel_layout_readable() -> bool:
    """Whether `kernel_codes` reads this build's kernel operand back to the codes it was made from
    (what `int4_experts_in_place` relies on): blocks of B = `kernel_block_rows` output rows, each
    stored K-major as B/2 bytes per input position, byte j holding the block's row j (low nibble)
    and row j + B/2 (high nibble)."""
    rows = kernel_block_rows()
    if rows is None:
        return False
    codes = torch.randint(0, 16, (2 * rows, 64), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    return torch.equal(kernel_codes(_convert(codes), rows), codes)


def kernel_codes(weight: torch.Tensor, block_rows: int) -> torch.Tensor:
    """The kernel's u8 operand [N, K/2] -> the unsigned codes int32 [N, K] (q + 8) it holds: the
    readable form of the layout `int4_experts_in_place` reads."""
    n, k = weight.shape[0], 2 * weight.shape[1]
    blocks = weight.view(n // block_rows, k, block_rows // 2)
    halves = torch.stack([blocks & 15, blocks >> 4], dim=1)  # [N/B, 2, K, B/2]
    return halves.permute(0, 1, 3, 2).reshape(n, k).to(torch.int32)


def _blocked_matvec(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] fp32 times the int4 matrix whose kernel-layout codes are `weight` u8 [..., N/B, K, B/2]
    and whose group scales are `scale` fp32 [..., K/g, N] -> fp32 [..., N].

    Written as one expression for a compiled graph: the nibbles are unpacked inside the generated
    reduction loop, and the code offset leaves the loop: per group, sum_k x_k s (u_k - 8) =
    s (sum_k x_k u_k - 8 sum_k x_k)."""
    groups, rows = scale.shape[-2], scale.shape[-1]
    blocks, k_in, half = weight.shape[-3:]
    w = weight.view(*weight.shape[:-2], groups, k_in // groups, half)  # [..., N/B, G, g, B/2]
    xg = x.view(*x.shape[:-1], 1, groups, k_in // groups, 1)
    offset = 8 * xg.sum(-2)  # [..., 1, G, 1]
    s = scale.view(*scale.shape[:-1], blocks, 2, half).movedim(-4, -2)  # [..., N/B, 2, G, B/2]
    low = (((w & 15).float() * xg).sum(-2) - offset) * s[..., 0, :, :]
    high = (((w >> 4).float() * xg).sum(-2) - offset) * s[..., 1, :, :]
    return torch.stack([low.sum(-2), high.sum(-2)], dim=-2).reshape(*low.shape[:-3], rows)


def int4_experts_in_place(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, ops: ExpertOperands,
                          intermediate: int, out_features: int, act: str, situ_beta: float = 4.0,
                          situ_linear_beta: float = 25.0) -> torch.Tensor:
    """The weighted sum of each row's k experts, read in place from the stack -> fp32 [N, D].

    x [N, D]; weights, indices [N, k]; `ops` stacked with the block size `kernel_block_rows` reports
    (a layout `kernel_layout_readable` confirms; the group size is read off the scales). The form a
    compiled decode graph holds where the experts' operands would be gathered: the expert index
    becomes indirect indexing inside the generated dequantise-and-reduce loops (`_blocked_matvec`),
    so the selected experts' nibbles are read where they lie (no gathered copy, no kernel call) and
    each row meets only its own k experts.
    The contract is the kernel form's: bf16 activations into each projection, fp32 accumulation,
    gate|up rounded to bf16, the weighted hidden rows rounded to bf16, the routed sum rounded to
    bf16 once. Eagerly it is correct but slow (it materialises the unpacked weights):
    `int4_experts_one_token` is the eager form.
    """
    if int4_matvec.one_row_block():
        return int4_experts_by_matvec(x, weights, indices, ops, intermediate, out_features, act, situ_beta,
                                      situ_linear_beta)
    num_experts, rows13, half_in = ops.w13.shape
    half_b = ops.w2.shape[3]  # B/2: the w2 stack is block-major [D'/B, E, I, B/2]
    block = 2 * half_b
    xb = x.to(torch.bfloat16).float().unsqueeze(1)  # [N, 1, D]
    gate_up_w = ops.w13.view(num_experts, rows13 // block, 2 * half_in, half_b)[indices]  # [N, k, N13/B, D, B/2]
    gate_up = _blocked_matvec(xb, gate_up_w, ops.sz13[..., 0][:, indices].movedim(0, -2).float())
    gate_up = gate_up.to(torch.bfloat16).float()
    hidden = glu(gate_up[..., :intermediate], gate_up[..., intermediate:2 * intermediate], act, situ_beta,
                 situ_linear_beta)
    hidden = (hidden * weights.float().unsqueeze(-1)).to(torch.bfloat16).float()  # [N, k, I]
    down_w = ops.w2[:, indices].movedim(0, -3)  # [N, k, D'/B, I, B/2]
    y = _blocked_matvec(hidden, down_w, ops.sz2[..., 0][indices].float()).sum(1)
    return y[:, :out_features].to(torch.bfloat16).float()


def int4_experts_by_matvec(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, ops: ExpertOperands,
                           intermediate: int, out_features: int, act: str, situ_beta: float = 4.0,
                           situ_linear_beta: float = 25.0) -> torch.Tensor:
    """The weighted sum of each row's k experts through the one-row kernel (`ops.int4_matvec`), each
    selected expert read where it lies in the stack -> fp32 [N, D]. Two kernel calls: gate|up for
    every (row, expert) selection, then down on each selection's own weighted hidden row; the
    contract is `int4_experts_in_place`'s (and so torch's kernel's).
    x [N, D]; weights, indices [N, k]; `ops` stacked with the block size `kernel_block_rows` reports."""
    n, top_k = indices.shape
    num_experts, rows13, half_in = ops.w13.shape
    blocks, _, k_in, half_b = ops.w2.shape  # down: block-major [D'/B, E, I, B/2]
    block = 2 * half_b
    idx = indices.reshape(-1)
    xb = x.to(torch.bfloat16)
    if n > 1:
        xb = xb.repeat_interleave(top_k, dim=0)  # one row per selection; one row is shared by all
    gate_up = int4_matvec.expert_matvec(
        xb, ops.w13, ops.sz13, idx, 2 * intermediate, block, 2 * half_in // ops.sz13.shape[0],
        w_strides=(rows13 * half_in, half_in * block), s_strides=(2 * rows13, 2 * num_experts * rows13, 2))
    gate_up = gate_up.to(torch.bfloat16).float()
    hidden = glu(gate_up[:, :intermediate], gate_up[:, intermediate:], act, situ_beta, situ_linear_beta)
    hidden = (hidden * weights.reshape(-1, 1).float()).to(torch.bfloat16)  # [N*k, I]
    groups2, rows2 = ops.sz2.shape[1], ops.sz2.shape[2]
    y = int4_matvec.expert_matvec(
        hidden, ops.w2, ops.sz2, idx, out_features, block, k_in // groups2,
        w_strides=(k_in * half_b, num_experts * k_in * half_b), s_strides=(2 * groups2 * rows2, 2 * rows2, 2))
    return y.view(n, top_k, out_features).sum(1).to(torch.bfloat16).float()


def int4_experts_static(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, ops: ExpertOperands,
                        intermediate: int, out_features: int, group_size: int, act: str,
                        situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                        in_place: bool = False) -> torch.Tensor:
    """The weighted sum of each row's k experts, with shapes that never depend on the routing (no
    per-expert row counts read back to the host) -> fp32 [N, D].

    x [N, D]; weights, indices [N, k]; `ops` stacked with the block size `kernel_block_rows` reports.
    The forms follow `ops.moe.gathers_expert_weights` (the rule compiled decode plans its graph
    classes by):
    - few rows, in place (`in_place`, for a stack whose layout `kernel_layout_readable` confirms):
      `int4_experts_in_place`, each row's own k experts read where they lie;
    - few rows, gather: the N*k selected experts' operands are gathered and joined as in
      `int4_experts_one_token`, two kernel calls; every row runs against all N*k of them, and each
      row's hidden vector is kept only in its own k experts' columns (zeros elsewhere) for the down call;
    - all experts: two kernel calls on the stacks as the joint operands as they lie (no copy); each
      row's hidden vector is kept only where its router chose the expert, scaled by the routing weight.
    """
    n, top_k = indices.shape
    num_experts, rows13 = ops.w13.shape[0], ops.w13.shape[1]
    gather = gathers_expert_weights(n, top_k, num_experts)
    if gather and in_place:
        return int4_experts_in_place(x, weights, indices, ops, intermediate, out_features, act, situ_beta,
                                     situ_linear_beta)
    blocks, _, k_in, half_b = ops.w2.shape
    xb = (x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)).contiguous()
    if gather:
        idx = indices.reshape(-1)
        used = idx.shape[0]
        gate_up_w = ops.w13.index_select(0, idx).reshape(used * rows13, ops.w13.shape[2])
        gate_up_sz = ops.sz13.index_select(1, idx).reshape(ops.sz13.shape[0], used * rows13, 2)
        down_w = ops.w2.index_select(1, idx).reshape(blocks * 2 * half_b, used * k_in // 2)
        down_sz = ops.sz2.index_select(0, idx).reshape(used * ops.sz2.shape[1], ops.sz2.shape[2], 2)
        # Row r's own experts are slots r*k .. r*k + k - 1 of the gathered ones.
        own = torch.arange(used, device=x.device).view(1, used) // top_k == torch.arange(n, device=x.device).view(n, 1)
        scale = torch.where(own, weights.float().reshape(1, used), 0.0)
    else:
        used = num_experts
        gate_up_w = ops.w13.reshape(used * rows13, ops.w13.shape[2])
        gate_up_sz = ops.sz13.reshape(ops.sz13.shape[0], used * rows13, 2)
        down_w = ops.w2.reshape(blocks * 2 * half_b, used * k_in // 2)
        down_sz = ops.sz2.reshape(used * ops.sz2.shape[1], ops.sz2.shape[2], 2)
        scale = x.new_zeros(n, used, dtype=torch.float32).scatter_add_(1, indices, weights.float())
        own = x.new_zeros(n, used, dtype=torch.bool).scatter_(1, indices, True)
    gate_up = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, gate_up_w, group_size, gate_up_sz)
    gate_up = gate_up.view(n, used, rows13).float()
    hidden = glu(gate_up[..., :intermediate], gate_up[..., intermediate:2 * intermediate], act, situ_beta,
                 situ_linear_beta)
    # `where`, not a product with zeros: an expert a row does not use never leaks an inf or NaN in.
    hidden = torch.where(own.unsqueeze(-1), hidden * scale.unsqueeze(-1), 0.0)
    hidden = hidden.to(torch.bfloat16).reshape(n, used * intermediate)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(hidden, down_w, group_size, down_sz)
    return y[:, :out_features].float()
