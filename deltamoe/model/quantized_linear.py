"""`Int4Linear`: a bias-free Linear whose weight stays INT4 in memory and runs through the CPU
int4 kernels (`ops.int4_matmul`): W4A16, or W4A8 with dynamic int8 or fp8 activations.

It holds the kernel's operand (torch's private layout), not the checkpoint's int32 words:
those are converted once as they load (`load_part`), so the resident weight is 0.5 byte per
value plus the group scales. Without the kernel (a torch build that lacks it) it keeps the
u8 nibbles and runs the dequantising reference instead, which the tests compare it with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from deltamoe.errors import CheckpointError
from deltamoe.model.quant_scheme import PARTS, QuantScheme, int4_parts
from deltamoe.ops import int4_matmul as q4
from deltamoe.ops import int4_matvec
from deltamoe.ops.int4_experts import STACK_ROW_MULTIPLE

if TYPE_CHECKING:
    from deltamoe.model.int4_projection_group import Int4ProjectionGroup


class Int4Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, use_kernel: bool | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_size = scheme.group_size
        self.activations = scheme.activations  # None (W4A16) | "int8" | "fp8"
        kernel = q4.has_w4a8_int8_kernel() if self.activations == "int8" else q4.has_int4_cpu_kernel()
        self.use_kernel = kernel if use_kernel is None else use_kernel
        # Plain attributes, not buffers: a model-wide `.to(dtype)` must not recast the kernel's
        # bf16 scale operand, and they exist only once a checkpoint is loaded.
        self.weight_scale: torch.Tensor | None = None  # bf16 [N, K/g]
        self.qweight: torch.Tensor | None = None  # the matmul's weight operand, set by load_weight
        self.scales_and_zeros: torch.Tensor | None = None  # the int4 kernel's scale operand
        self.loaded: dict[str, torch.Tensor] = {}
        # Set when this projection joins others of the same input (`model/int4_projection_group.py`).
        self.group: Int4ProjectionGroup | None = None
        self.group_start = 0  # this projection's first row in the group's joint output

    def load_part(self, name: str, part: str, tensor: torch.Tensor) -> None:
        """Take one published tensor (`weight_packed`, `weight_scale`, `weight_shape`); once all are
        here, convert them to the kernel's operands."""
        if part not in PARTS["int4"]:
            raise CheckpointError(f"unexpected tensor {name} for an int4 Linear", field=name)
        self.loaded[part] = tensor
        if len(self.loaded) == len(PARTS["int4"]):
            packed, scale = int4_parts(name, self.loaded, self.group_size)
            if tuple(self.loaded["weight_shape"].tolist()) != (self.out_features, self.in_features):
                raise CheckpointError(f"weight_shape {tuple(self.loaded['weight_shape'].tolist())}, model "
                                      f"{(self.out_features, self.in_features)}", field=name)
            self.load_weight(packed, scale)
            self.loaded = {}

    def load_weight(self, packed: torch.Tensor, scale: torch.Tensor) -> None:
        """From `ops.quant.quantize_int4`'s (u8 [N, K/2], bf16 [N, K/g])."""
        self.weight_scale = scale.to(torch.bfloat16).contiguous()
        if not self.use_kernel:
            self.qweight = packed.contiguous()
        elif self.activations == "int8":
            self.qweight = q4.w4a8_int8_weight(packed, scale, self.group_size)
        else:
            # Rows padded to the stack multiple, so the operand can join a projection group.
            self.qweight, self.scales_and_zeros = q4.int4_kernel_weight(packed, scale, self.group_size,
                                                                        row_multiple=STACK_ROW_MULTIPLE)
            int4_matvec.one_row_block()  # decided (and built) now, not inside a compiled graph

    @property
    def is_loaded(self) -> bool:
        return self.qweight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            raise RuntimeError("Int4Linear: no weight loaded")
        if self.group is not None:
            return self.group.output(self, x)
        n, g = self.out_features, self.group_size
        if self.activations == "fp8":
            amax = self.row_amax(x)
            if not self.use_kernel:
                return q4.w4a8_fp8_matmul_reference(x, self.qweight, self.weight_scale, g, amax)
            return q4.w4a8_fp8_matmul(x, self.qweight, self.scales_and_zeros, n, g, amax)
        if not self.use_kernel:
            ref = {None: q4.int4_matmul_reference, "int8": q4.w4a8_int8_matmul_reference}[self.activations]
            return ref(x, self.qweight, self.weight_scale, g)
        if self.activations == "int8":
            return q4.w4a8_int8_matmul(x, self.qweight, self.in_features, n, g)
        return q4.int4_matmul(x, self.qweight, self.scales_and_zeros, n, g)

    def row_amax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each input row's absolute maximum for the fp8 activation scale; None: x's own rows (a row-parallel
        shard, whose rows are slices, takes the whole rows' maxima: serve/executor/int4_shards.py)."""
        return None

    def resident_bytes(self) -> int:
        tensors = [self.qweight, self.scales_and_zeros, self.weight_scale]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def extra_repr(self) -> str:
        mode = "W4A16" if self.activations is None else f"W4A8-{self.activations}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"{mode}, kernel={self.use_kernel}")
