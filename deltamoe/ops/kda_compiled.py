"""`chunk_kda` with its state-independent terms compiled by torch.compile (inductor's C++ kernels
on a CPU): prefill and training forward at long T.

What compiles is `kda._chunk_terms` for one group of chunks: the layout copies, the l2 norm, the
decay factors (exp of the centred cumulative decays), the masks and the scalings between its
matmuls are elementwise work over [chunks, B*H, C, K] that inductor fuses into a few passes;
the matmuls and the triangular solve stay the ATen (MKL) calls they are. The sequential state pass
and the chunk length stay eager: the pass is matmuls of a few hundred microseconds each with one
elementwise update between them, and the chunk length depends on the data (`_pick_chunk_size`).

Graph classes: one per (chunk length, scale, l2 norm) and the tensors' dtype, head count and head
sizes; the token count is dynamic, so the groups of a long sequence and its shorter last group
share one graph. Every class costs a compile (seconds) the first time it runs in a process: the
eager `chunk_kda` stays the default, and this form is for long prefills and training runs where
that pays back. Its result equals `chunk_kda`'s to float rounding (tests/ops/test_kda_compiled.py).
Dynamo keeps up to `torch._dynamo.config.recompile_limit` graphs for the one traced function;
past that it warns and runs the terms eagerly (same result).
"""

from __future__ import annotations

import functools

import torch

from deltamoe.ops import kda


@functools.cache
def _compiled_terms(chunk: int, scale: float, use_qk_l2norm: bool) -> kda.TermsFn:
    """The compiled `_chunk_terms` of one graph class; the token dim of its inputs is dynamic."""

    def terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> kda._ChunkTerms:
        return kda._chunk_terms(q, k, v, g, beta, scale, use_qk_l2norm, chunk)

    return torch.compile(terms, dynamic=None)


def _terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
           use_qk_l2norm: bool, chunk: int) -> kda._ChunkTerms:
    for x in (q, k, v, g, beta):
        torch._dynamo.maybe_mark_dynamic(x, 1)  # [B, T, H, *]: one graph for every token count
    return _compiled_terms(chunk, scale, use_qk_l2norm)(q, k, v, g, beta)


def compiled_chunk_kda(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`kda.chunk_kda`, same arguments and result, with the compiled state-independent terms."""
    return kda.chunk_kda(*args, terms_fn=_terms, **kwargs)
