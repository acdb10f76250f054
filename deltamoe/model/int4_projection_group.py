"""Int4 projections that read the same input, run as one kernel call (W4A16 decode).

A decode step at batch 1 is bound by per-call overhead, not by weight reads: a KDA layer
projects its input six times (q, k, v, forget-gate down, beta, output gate), each a separate
small int4 matmul with its own activation casts. The kernel's operand is blocked by output
rows (`ops.int4_experts.kernel_block_rows`), so the operands of projections of the same input
dim, each padded to `STACK_ROW_MULTIPLE` rows, concatenated along the output dim are the
operand of the concatenated matrix: one call computes every member's output.

`join_shared_input_projections` (run once the weights are loaded) builds an
`Int4ProjectionGroup` for each set in `SHARED_INPUT`, stores the joint operand once and points
each member's weight at its rows (a view: no second copy). A member called with the tensor the
group last ran on returns its slice of that joint output; any other input (or a second call by
the same member, or an in-place write to the input where torch tracks one) runs the joint call
first. The model's forward code is unchanged: the members are still called one by one, in the
order the layer needs them, and every output equals the member's own call (tests hold them to it).

The same code runs inside a compiled decode graph (`serve/engine/compiled_decode.py`): dynamo
evaluates the bookkeeping while it traces, so the graph holds one joint call per group and each
member's slice of it. A member is known by its first row in the joint output (`group_start`, a
plain int that survives the module copies the compiled form makes), and the input's version is
not read there (dynamo cannot; a graph never writes its inputs in place between two calls).
"""

from __future__ import annotations

import torch
from torch import nn

from deltamoe.model.quantized_linear import Int4Linear
from deltamoe.ops.int4_experts import STACK_ROW_MULTIPLE, kernel_block_rows
from deltamoe.ops.int4_matmul import int4_matmul

# Per module class: the submodules (dotted names) that its forward feeds the same input tensor.
# A projection joins one group: the first that names it, in module order (a MoE's set takes its
# shared expert's gate and up before that DenseMLP's own set is reached).
SHARED_INPUT = {
    "KimiDeltaAttention": ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_proj", "g_a_proj"),
    "LatentAttention": ("q_proj", "q_a_proj", "kv_a_proj_with_mqa", "g_proj", "indexer.wk", "indexer.weights_proj"),
    "DenseMLP": ("gate_proj", "up_proj"),
    "MoE": ("routed_expert_down_proj", "shared_experts.gate_proj", "shared_experts.up_proj"),
}


class Int4ProjectionGroup:
    """The joint kernel operand of several W4A16 `Int4Linear`s with one input dim, and the last joint output."""

    def __init__(self, members: list[Int4Linear]):
        first = members[0]
        self.group_size = first.group_size
        self.weight = torch.cat([m.qweight for m in members])
        self.scales_and_zeros = torch.cat([m.scales_and_zeros for m in members], dim=1)
        self.rows = self.scales_and_zeros.shape[1]
        self.starts: list[int] = []
        start, row_start = 0, 0
        for m in members:
            rows, size = m.scales_and_zeros.shape[1], m.qweight.shape[0]
            self.starts.append(row_start)
            m.group_start = row_start
            # The member's rows of the joint operands: views, so the weights are held once (its calls
            # go through the group: the kernel reads a scale operand as contiguous).
            m.qweight = self.weight[start:start + size]
            m.scales_and_zeros = self.scales_and_zeros[:, row_start:row_start + rows]
            start += size
            row_start += rows
        # The input of the last joint call, its version (None for inference tensors, which keep
        # none), the joint output, and the members that have not taken their columns of it yet.
        self._input: torch.Tensor | None = None
        self._version: int | None = None
        self._output: torch.Tensor | None = None
        self._waiting: set[int] = set()

    def output(self, member: Int4Linear, x: torch.Tensor) -> torch.Tensor:
        """`member`'s output for x: its columns of the joint call on x. Each joint output serves
        each member once, then is dropped."""
        start = member.group_start
        if start not in self._waiting or x is not self._input or _version(x) != self._version:
            self._output = int4_matmul(x, self.weight, self.scales_and_zeros, self.rows, self.group_size)
            self._input, self._version, self._waiting = x, _version(x), set(self.starts)
        self._waiting.discard(start)
        out = self._output[..., start:start + member.out_features]
        if not self._waiting:
            self._input = self._output = None
        return out


def _version(x: torch.Tensor) -> int | None:
    if torch.compiler.is_compiling():  # see the module docstring
        return None
    return None if x.is_inference() else x._version


def _groupable(m: nn.Module | None) -> bool:
    return isinstance(m, Int4Linear) and m.group is None and m.use_kernel and m.activations is None \
        and m.is_loaded and m.scales_and_zeros is not None and m.scales_and_zeros.shape[1] % STACK_ROW_MULTIPLE == 0


def join_shared_input_projections(model: nn.Module) -> int:
    """Join each `SHARED_INPUT` set of loaded W4A16 int4 projections into one group; returns how many
    groups. Nothing is joined when the kernel's block layout is unknown."""
    if kernel_block_rows() is None:
        return 0
    count = 0
    for module in model.modules():
        names = SHARED_INPUT.get(type(module).__name__, ())
        members = [m for m in (_submodule(module, n) for n in names) if _groupable(m)]
        by_input: dict[tuple[int, int], list[Int4Linear]] = {}
        for m in members:
            by_input.setdefault((m.in_features, m.group_size), []).append(m)
        for same in by_input.values():
            if len(same) > 1:
                group = Int4ProjectionGroup(same)
                for m in same:
                    m.group = group
                count += 1
    return count


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None
