"""`PackedExperts`: a layer's routed experts kept in their checkpoint format in memory.

- MXFP4 (native K3): the E2M1 codes and E8M0 scales of every expert stay as loaded (0.53
  byte per weight, about a quarter of bf16) and an expert is dequantised to the activation
  dtype only when tokens are routed to it (no mature CPU MXFP4 matmul exists).
- INT4 W4A16 with the CPU int4 kernel: an `Int4ExpertStack` (every expert's operands in one
  tensor, so a one-token step runs its k experts in two kernel calls).
- INT4 otherwise (w4a8, or the dequantising reference): each expert projection is an `Int4Linear`.

It replaces `RoutedExperts` (same place in the module tree, `block_sparse_moe.experts`) and
`packed_local_experts` replaces the MoE's dispatcher; `packed_experts_static_dispatcher` gives the
form a compiled decode graph holds, for the formats that have one.
"""

from __future__ import annotations

import torch
from torch import nn

from deltamoe.config import ModelConfig
from deltamoe.errors import CheckpointError, ConfigError
from deltamoe.model.int4_expert_stack import PROJECTIONS, Int4ExpertStack
from deltamoe.model.quant_scheme import PARTS, QuantScheme
from deltamoe.model.quantized_linear import Int4Linear
from deltamoe.ops.activations import glu
from deltamoe.ops.int4_experts import all_experts_budget
from deltamoe.ops.int4_matmul import has_int4_cpu_kernel
from deltamoe.ops.packed_experts import experts_forward_by_expert
from deltamoe.ops.quant import MXFP4_GROUP, dequantize_mxfp4, dequantize_mxfp4_bf16


class PackedExperts(nn.Module):
    def __init__(self, config: ModelConfig, scheme: QuantScheme, use_kernel: bool | None = None,
                 held: range | None = None):
        """`held`: the experts (global ids, a contiguous range) this module holds: all of them, or an
        expert-parallel rank's share (`local_share`), which it indexes 0.. in `forward`."""
        super().__init__()
        self.config = config
        self.scheme = scheme
        self.use_kernel = use_kernel
        self.held = range(config.num_experts) if held is None else held
        e, i, d = len(self.held), config.moe_intermediate_size, config.expert_dim
        self.shapes = {"w1": (i, d), "w3": (i, d), "w2": (d, i)}  # [out, in] per expert
        self.num_experts = e
        self.stack: Int4ExpertStack | None = None
        if scheme.weight_format == "int4" and scheme.activations is None \
                and (has_int4_cpu_kernel() if use_kernel is None else use_kernel):
            self.stack = Int4ExpertStack(config, scheme, e)
        elif scheme.weight_format == "int4":
            self.linears = nn.ModuleDict({w: nn.ModuleList(Int4Linear(s[1], s[0], scheme, use_kernel)
                                                        for _ in range(e))
                                          for w, s in self.shapes.items()})
        else:
            # Allocated by the first tensor that loads (the model skeleton is built on meta).
            self.packed: dict[str, torch.Tensor] = {}
            self.scale: dict[str, torch.Tensor] = {}
        self.loaded: set[tuple[str, int, str]] = set()

    def load_part(self, name: str, proj: str, expert: int, part: str, tensor: torch.Tensor) -> None:
        """One published tensor of one expert (`experts.E.w1.weight_packed`, ...; E global)."""
        if not 0 <= expert < self.config.num_experts:
            raise CheckpointError(f"expert index {expert} out of range (num_experts={self.config.num_experts})",
                                  field=name)
        if expert not in self.held:
            raise CheckpointError(f"expert {expert} is not among this rank's experts {self.held.start}.."
                                  f"{self.held.stop - 1}", field=name)
        global_id, expert = expert, expert - self.held.start
        if part not in PARTS[self.scheme.weight_format]:
            raise CheckpointError(f"unexpected tensor {name} for {self.scheme.weight_format} experts", field=name)
        if self.stack is not None:
            self.stack.load_part(name, proj, expert, part, tensor)
        elif self.scheme.weight_format == "int4":
            self.linears[proj][expert].load_part(name, part, tensor)
        else:
            rows, cols = self.shapes[proj]
            expect = (rows, cols // 2) if part == "weight_packed" else (rows, cols // MXFP4_GROUP)
            if tuple(tensor.shape) != expect or tensor.dtype != torch.uint8:
                raise CheckpointError(f"shape mismatch for {name}: checkpoint {tensor.dtype} {tuple(tensor.shape)}, "
                                      f"model uint8 {expect}", field=name)
            store = self.packed if part == "weight_packed" else self.scale
            if proj not in store:
                store[proj] = torch.empty(self.num_experts, *expect, dtype=torch.uint8)
            store[proj][expert].copy_(tensor)
        self.loaded.add((proj, global_id, part))

    def missing(self) -> str | None:
        """The first published tensor not loaded yet, as `E.w1.weight_scale` (E global), or None."""
        for w in PROJECTIONS:
            for e in self.held:
                for part in PARTS[self.scheme.weight_format]:
                    if (w, e, part) not in self.loaded:
                        return f"{e}.{w}.{part}"
        return None

    def local_share(self, rank: int, size: int) -> "PackedExperts":
        """An empty module for expert-parallel rank `rank` of `size`: experts [rank * E / size, ...) of
        this (still unloaded) one, to load from the checkpoint's per-expert tensors."""
        if self.loaded:
            raise RuntimeError("local_share: cut the experts before loading them (a meta-built skeleton)")
        per = self.config.num_experts // size
        return PackedExperts(self.config, self.scheme, self.use_kernel, range(rank * per, (rank + 1) * per))

    def expert_weight(self, proj: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """MXFP4: one expert's projection dequantised to `dtype`."""
        packed, scale = self.packed[proj][expert], self.scale[proj][expert]
        if dtype in (torch.bfloat16, torch.float32):  # both hold every MXFP4 value exactly
            return dequantize_mxfp4_bf16(packed, scale).to(dtype)
        return dequantize_mxfp4(packed, scale, dtype=dtype)

    def expert_mlp(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if self.stack is not None:
            return self.stack.expert_mlp(expert, x)
        if self.scheme.weight_format == "int4":
            lin = {w: self.linears[w][expert] for w in PROJECTIONS}
            hidden = glu(lin["w1"](x), lin["w3"](x), c.hidden_act, c.situ_beta, c.situ_linear_beta)
            return lin["w2"](hidden)
        w1, w3, w2 = (self.expert_weight(w, expert, x.dtype) for w in PROJECTIONS)
        return glu(x @ w1.T, x @ w3.T, c.hidden_act, c.situ_beta, c.situ_linear_beta) @ w2.T

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if self.stack is not None:
            return self.stack(x, weights, indices)
        return experts_forward_by_expert(x, weights, indices, self.num_experts, self.expert_mlp)

    def resident_bytes(self) -> int:
        if self.stack is not None:
            return self.stack.resident_bytes()
        if self.scheme.weight_format == "int4":
            return sum(m.resident_bytes() for m in self.linears.modules() if isinstance(m, Int4Linear))
        return sum(t.numel() * t.element_size() for t in [*self.packed.values(), *self.scale.values()])


def packed_local_experts(z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                         experts: PackedExperts) -> torch.Tensor:
    """The MoE dispatcher for packed experts (same signature as `ffn.local_experts`)."""
    return experts(z, weights, indices)


def packed_experts_static_dispatcher(experts: PackedExperts):
    """The static dispatcher for `experts` (serve's compiled decode installs it on its own view of
    the model): `packed_local_experts` with shapes that never depend on the routing (int4 W4A16
    stacks), their all-experts budget bound now, at this process's thread count. ConfigError for
    the formats that have none (MXFP4, W4A8, the dequantising reference)."""
    if experts.stack is None:
        raise ConfigError(f"compiled decode runs int4 W4A16 experts on the CPU kernel, not "
                          f"{experts.scheme.weight_format} experts with activations={experts.scheme.activations} "
                          f"(run with --no-compile)", field="compile_decode")
    budget = all_experts_budget()

    def packed_local_experts_static(z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                                    experts: PackedExperts) -> torch.Tensor:
        return experts.stack.forward_static(z, weights, indices, budget)

    return packed_local_experts_static
