"""`Int4ExpertStack`: a layer's routed INT4 (W4A16) experts as stacked CPU-kernel operands.

Every expert's gate|up operand and down operand (`ops.int4_experts`) sit in one tensor each
(`ExpertOperands`, in the order a one-token gather reads them),
so a one-token decode step gathers its k experts and runs them in two kernel calls, and
any other batch runs expert by expert in two calls each. A compiled decode graph's few rows
read their experts in place instead (`forward_static`: `ops.int4_experts.int4_experts_in_place`),
and its many rows over many experts run the expert-by-expert loop as one opaque op
(`ops.sorted_experts_op.int4_sorted_experts`, where `ops.moe.static_expert_form` says so).
The checkpoint's per-expert tensors (`experts.E.w1.weight_packed`, ...) are converted as soon as
all of one expert's are here.
"""

from __future__ import annotations

import torch
from torch import nn

from deltamoe.config import ModelConfig
from deltamoe.errors import CheckpointError
from deltamoe.model.quant_scheme import PARTS, QuantScheme, int4_parts
from deltamoe.ops import int4_experts as ie
from deltamoe.ops import int4_matvec
from deltamoe.ops.moe import static_expert_form
from deltamoe.ops.sorted_experts_op import int4_sorted_experts

PROJECTIONS = ("w1", "w3", "w2")  # gate, up [I, D']; down [D', I]


class Int4ExpertStack(nn.Module):
    def __init__(self, config: ModelConfig, scheme: QuantScheme, num_experts: int | None = None):
        """`num_experts`: how many experts the stack holds (default: all; an expert-parallel rank's share)."""
        super().__init__()
        if scheme.activations is not None:
            raise ValueError(f"activations: the expert stack runs W4A16 only, got {scheme.activations!r}")
        self.config = config
        self.group_size = scheme.group_size
        self.num_experts = config.num_experts if num_experts is None else num_experts
        self.intermediate, self.dim = config.moe_intermediate_size, config.expert_dim
        self.block_rows = ie.kernel_block_rows()  # None: no one-token gather, experts run one at a time
        self.in_place = ie.kernel_layout_readable()  # a compiled graph's few rows read their experts in place
        int4_matvec.one_row_block()  # decided (and built) now, not inside a compiled graph
        # A plain attribute (kernel layouts a model-wide `.to(dtype)` must not touch), allocated
        # when the first expert is converted.
        self.ops: ie.ExpertOperands | None = None
        self.pending: dict[int, dict[str, dict[str, torch.Tensor]]] = {}

    def load_part(self, name: str, proj: str, expert: int, part: str, tensor: torch.Tensor) -> None:
        """One published tensor of one expert; once all of that expert's are here, convert them."""
        parts = self.pending.setdefault(expert, {}).setdefault(proj, {})
        parts[part] = tensor
        if len(parts) == len(PARTS["int4"]):
            rows, cols = (self.dim, self.intermediate) if proj == "w2" else (self.intermediate, self.dim)
            if tuple(parts["weight_shape"].tolist()) != (rows, cols):
                raise CheckpointError(f"weight_shape {tuple(parts['weight_shape'].tolist())}, model {(rows, cols)}",
                                      field=name)
            parts["quantized"] = int4_parts(name, parts, self.group_size)
        done = self.pending[expert]
        if all("quantized" in done.get(p, {}) for p in PROJECTIONS):
            del self.pending[expert]
            self._store(expert, *(done[p]["quantized"] for p in PROJECTIONS))

    def _store(self, expert: int, w1: tuple, w3: tuple, w2: tuple) -> None:
        gate_up, down = ie.gate_up_operand(w1, w3, self.group_size), ie.down_operand(w2, self.group_size)
        if self.ops is None:
            self.ops = ie.ExpertOperands.empty(self.num_experts, gate_up, down, self.block_rows)
        self.ops.put(expert, gate_up, down)

    def _act(self) -> tuple[str, float, float]:
        c = self.config
        return c.hidden_act, c.situ_beta, c.situ_linear_beta

    def expert_mlp(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return ie.int4_expert_mlp(x, *self.ops.expert(expert), self.intermediate, self.dim, self.group_size,
                                  *self._act())

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if self.ops is None:
            raise RuntimeError("Int4ExpertStack: no experts loaded")
        if x.shape[0] == 1 and self.block_rows is not None and x.dtype != torch.float64:
            return ie.int4_experts_one_token(x, weights, indices, self.ops, self.intermediate, self.dim,
                                             self.group_size, *self._act())
        return ie.int4_experts_by_expert(x, weights, indices, self.ops, self.intermediate, self.dim, self.group_size,
                                         *self._act())

    def forward_static(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                       extra_macs_per_expert: int) -> torch.Tensor:
        """`forward` with shapes that never depend on the routing (`ops.int4_experts.int4_experts_static`),
        or, where every expert on every row would multiply more than `extra_macs_per_expert` (the
        budget, `ops.int4_experts.all_experts_budget()`), the expert-by-expert loop as one op of the graph."""
        if self.ops is None:
            raise RuntimeError("Int4ExpertStack: no experts loaded")
        if static_expert_form(x.shape[0], indices.shape[1], self.num_experts, self.dim, self.intermediate,
                              extra_macs_per_expert) == "sorted":
            o = self.ops
            return int4_sorted_experts(x, weights, indices, o.w13, o.sz13, o.w2, o.sz2, self.intermediate, self.dim,
                                       self.group_size, *self._act())
        return ie.int4_experts_static(x, weights, indices, self.ops, self.intermediate, self.dim, self.group_size,
                                      *self._act(), in_place=self.in_place)

    def resident_bytes(self) -> int:
        return 0 if self.ops is None else self.ops.resident_bytes()

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, intermediate={self.intermediate}, dim={self.dim}, "
                f"group_size={self.group_size}, block_rows={self.block_rows}")
