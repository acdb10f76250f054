"""An inductor graph pass for the compiled decode graph: one-row matmuls become fused reductions.

A decode step of one sequence multiplies a single row by every weight matrix: ~60 calls of
[1, K] @ [K, N] for a small model, each a BLAS call whose fixed cost (a few microseconds) is
most of its time on a CPU. Written as `(row[:, :, None] * weight).sum(1)`, inductor fuses each
into its neighbouring elementwise kernels (norms, activations, gates), reading the weight once
with vector loads along K. Measured on bench/bench_serve_dsa_decode.py's model: a one-sequence
step at 1k context 2.1 -> 1.2 ms.

Only plain matrix products whose row count is statically 1 (torch compiles batch 1 as its own
graph) and whose weight has static dims are rewritten. Batched matmuls (`bmm`: attention over
the context, the DSA indexer's 8 heads over its keys) are left as inductor lowers them:
decomposed, their long reductions over thousands of cached rows ran 2.5-3.5x slower (dense MLA
at 32k context 13 -> 32-45 ms a step). That is why inductor's own `decompose_mm_pass`, which
also rewrites every single-batch `bmm` on CPUs, is not used.

The sum runs in fp32 for any input dtype and is rounded back once, as a BLAS call accumulates.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import Arg, CallFunction, Match, PatternMatcherPass, register_graph_pattern
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten
_patterns = PatternMatcherPass(pass_name="deltamoe_decode_matvec")


def _one_row_times_matrix(row: torch.fx.Node, matrix: torch.fx.Node) -> bool:
    row_val, matrix_val = row.meta.get("val"), matrix.meta.get("val")
    if not isinstance(row_val, torch.Tensor) or not isinstance(matrix_val, torch.Tensor):
        return False
    return (row_val.dim() == 2 and matrix_val.dim() == 2 and row_val.device.type == "cpu"
            and statically_known_true(row_val.shape[0] == 1)
            and all(isinstance(d, int) for d in matrix_val.shape))


def _row_times_matrix(row: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    return (row.float()[:, :, None] * matrix.float()[None]).sum(1).to(row.dtype)


@register_graph_pattern(CallFunction(aten.mm, Arg(), Arg()), pass_dict=_patterns)
def _mm(match: Match, row: torch.fx.Node, matrix: torch.fx.Node) -> None:
    if _one_row_times_matrix(row, matrix):
        match.replace_by_example(_row_times_matrix, [row, matrix])


@register_graph_pattern(CallFunction(aten.addmm, Arg(), Arg(), Arg()), pass_dict=_patterns)
def _addmm(match: Match, bias: torch.fx.Node, row: torch.fx.Node, matrix: torch.fx.Node) -> None:
    if _one_row_times_matrix(row, matrix):
        match.replace_by_example(lambda b, r, m: _row_times_matrix(r, m) + b, [bias, row, matrix])


class DecodeMatvecPass(CustomGraphPass):
    """`torch.compile(..., options={"post_grad_custom_post_pass": DecodeMatvecPass()})`."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        _patterns.apply(graph)
        graph.eliminate_dead_code()

    def uuid(self) -> Any:
        # Inductor's on-disk cache keys graphs on this: a change to this file recompiles.
        return get_hash_for_files((__file__,))
