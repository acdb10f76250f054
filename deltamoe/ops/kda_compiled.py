"""`chunk_kda` with groups of chunk steps compiled by torch.compile (inductor's C++ kernels on a
CPU): prefill and training forward at long T.

One compiled call covers `group_chunks` consecutive chunks of the sequence: their
state-independent terms (`kda._chunk_terms`), the chunk steps one after another (the state
update and each chunk's output, `kda._differentiable_state_pass`) and the layout of o back into
token order. Inductor fuses the elementwise work between the matmuls (layout copies, the l2 norm,
the decay factors, masks, the state's decay, the stacking of outputs) into a few loops over data
still in cache, plans the group's buffers once, and turns the per-op dispatch of the eager loop
into one call per group; the matmuls and the triangular solve stay the ATen (MKL) calls they are.

The chunk length is picked once per call (`kda._pick_chunk_size`, data-dependent, eager), and the
sequences of a batch run one after another, so a graph class is one (chunk length, chunks per
group, scale, l2 norm) with the tensors' dtype, head count and head sizes, all static, whatever B
and T. The tail of a sequence that does not fill a whole group runs the same steps eagerly. Every
class costs a compile (seconds) the first time it runs in a process: the eager `chunk_kda` stays
the model's default, and this form is for long prefills and training runs where that pays back.
Dynamo keeps up to `torch._dynamo.config.recompile_limit` classes per (chunk length, scale, l2
norm); past that it warns and runs the steps eagerly (same result). Its result equals
`chunk_kda`'s to float rounding (tests/ops/test_kda_compiled.py).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from deltamoe.ops import kda
from deltamoe.ops.autocast import full_precision

# Chunk steps per compiled call: enough to fuse across chunks and amortize the call (with its guard
# checks and buffer plan) over K = 128 heads' chunk steps, few enough that a group's terms stay in
# cache and its graph compiles in seconds (docs/model.md, "The compiled chunked op and autocast").
GROUP_CHUNKS = 16

GroupFn = Callable[..., torch.Tensor]


def _group_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, out: torch.Tensor, scale: float, use_qk_l2norm: bool, chunk: int) -> torch.Tensor:
    """A run of whole chunks of one sequence [T, H, *] from the state entering it [H, K, V]: writes
    o into `out` [T, H, V] (a view of the whole output) and returns the state after the run."""
    terms = kda._chunk_terms(*(x.unsqueeze(0) for x in (q, k, v, g, beta)), scale, use_qk_l2norm, chunk)
    # The functional pass (a new tensor per product): inductor plans its buffers itself, and it is
    # the form autograd needs.
    chunk_o, state = kda._differentiable_state_pass(terms, state)
    kda._copy_to_tokens(chunk_o, out.unsqueeze(0))
    return state


@functools.cache
def _compiled_group(chunk: int, scale: float, use_qk_l2norm: bool) -> GroupFn:
    """The compiled `_group_steps` of one (chunk length, scale, l2 norm). Shapes are static: a
    sequence's slices [T, H, *] have the same strides whatever the batch and the whole length."""

    def steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return _group_steps(q, k, v, g, beta, state, out, scale, use_qk_l2norm, chunk)

    return torch.compile(steps, dynamic=False)


@full_precision
def compiled_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    chunk_size: int | None = None,
    group_chunks: int = GROUP_CHUNKS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`kda.chunk_kda`, same arguments and result, with every `group_chunks` chunks one compiled call.

    Returns (o [B, T, H, V] in v.dtype, final state [B, H, K, V] or None).
    """
    (b, t, h, dk, dv), scale, chunk_size = kda._check_chunked_inputs(q, k, v, g, beta, initial_state, chunk_size,
                                                                     scale)
    if group_chunks < 1:
        raise ValueError(f"group_chunks: expected a positive integer, got {group_chunks}")
    dtype, out_dtype = kda._compute_dtype(q, k, v, g, beta), v.dtype
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    chunk = kda._pick_chunk_size(g, chunk_size)
    group = chunk * group_chunks
    compiled = _compiled_group(chunk, scale, use_qk_l2norm)
    eager = functools.partial(_group_steps, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk=chunk)

    # One sequence after another: the compiled call's inputs are its slices [T, H, *], whose
    # strides do not depend on B or on the whole length (no recompile for another T).
    o = v.new_empty(b, t, h, dv)
    final_states = []
    for i in range(b):
        state = q.new_zeros(h, dk, dv) if initial_state is None else initial_state[i].to(dtype)
        for start in range(0, t, group):
            part = slice(start, start + group)
            steps = compiled if start + group <= t else eager  # a tail shorter than a group: eager
            state = steps(q[i, part], k[i, part], v[i, part], g[i, part], beta[i, part], state, o[i, part])
        final_states.append(state)
    return o.to(out_dtype), (torch.stack(final_states) if output_final_state else None)
