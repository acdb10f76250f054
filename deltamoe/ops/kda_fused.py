"""Chunked KDA prefill through a fused C++ kernel of our own (`csrc/kda_chunk.cpp`), for inference.

`chunk_kda` (ops/kda.py) runs its steps as torch ops over groups of chunks: at K = V = 128 every
intermediate of a group is a megabyte that leaves the cache between ops, and the products are
small batched matmuls. The kernel does the same steps, in the same order, one (batch, head) at a
time and one chunk after another, every intermediate in per-thread tiles, each product one call
of oneDNN's gemm micro-kernel; threads split the (batch, head) pairs. It computes in fp32 with no autograd, so
`chunk_kda` sends it only calls that record no gradient, in fp32 (not fp64), on the CPU, and
keeps its own path for the rest; the chunk lengths are `chunk_kda`'s own (the same groups, each
with `_pick_chunk_size`'s length), so both walk the same chunks and differ only in the order of
fp32 sums (tests/ops/test_kda_fused.py holds both to `recurrent_kda`).

Built by `scripts/bootstrap.sh` at setup, else on first use (`cpp_build`; g++ and ninja; ~10 s,
cached), with the vector exps of glibc's libmvec. Without a compiler or AVX2, or with
`DELTAMOE_KDA_KERNEL=0`, `chunk_kda` keeps its torch path; `status()` says which and why.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from deltamoe.ops.cpp_build import kernel_status, load_cpp_extension

SOURCE = Path(__file__).parent / "csrc" / "kda_chunk.cpp"
ENV_SWITCH = "DELTAMOE_KDA_KERNEL"  # "0" turns the kernel off (A/B runs, a suspect build)

# The chunk length the kernel runs when the caller names none (`chunk_kda`'s default is the head
# size, up to 64, for its torch path). In the kernel a token's share of the state products (K x V
# per token, whatever C) stays, while its share of the intra-chunk products and the solve grows
# with C, and the small per-chunk products stay efficient in the tiles: at K = V = 128, T = 8192,
# 2 threads it measured 48.6 / 50.3 / 59.6 ms at C = 16 / 32 / 64, at K = 32 9.3 / 10.1 / 13.3 ms.
DEFAULT_CHUNK = 16
MAX_CHUNK = 256  # longer chunks (a caller's `chunk_size`) keep the torch path: the kernel's tiles are C x C

_turned_off = False  # `turned_off()`: the tests and benchmarks time and compare both paths


@functools.cache
def _build() -> str | None:
    """Compile and load the extension; None when it loaded, else why not."""
    flags = ["-O3", "-fno-math-errno", "-fopenmp-simd"]
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        flags += ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-mprefer-vector-width=512"]
    else:
        flags += ["-mavx2", "-mfma"]
    return load_cpp_extension("deltamoe_kda_chunk", SOURCE, flags, ["-lmvec"])


@functools.cache
def status() -> str:
    """'on', or why the kernel is not used here."""
    return kernel_status("KDA chunk kernel", ENV_SWITCH, _build, "chunk_kda's torch path")


def usable(*tensors: torch.Tensor) -> bool:
    """Whether a `chunk_kda` call over these inputs runs the kernel: CPU, fp32 compute (no fp64
    input), no gradient recorded, not inside a compiled graph, and the kernel built."""
    if _turned_off or torch.compiler.is_compiling():
        return False
    if any(t.device.type != "cpu" or t.dtype == torch.float64 for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return status() == "on"


@contextlib.contextmanager
def turned_off():
    """Inside the block `chunk_kda` runs its torch path: tests compare both, benchmarks time both."""
    global _turned_off
    saved, _turned_off = _turned_off, True
    try:
        yield
    finally:
        _turned_off = saved


def chunk_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, segments: list[tuple[int, int, int]], scale: float, use_qk_l2norm: bool,
                  eps: float) -> torch.Tensor:
    """o [B, T, H, V] fp32 of the chunked form over q, k, g [B, T, H, K], v [B, T, H, V], beta
    [B, T, H]; `state` [B*H, K, V] fp32 enters token 0 and holds the final state afterwards.
    `segments`: (first token, end token, chunk length) runs covering [0, T) in order."""
    args = [x.float().contiguous() for x in (q, k, v, g, beta)]
    flat = [n for run in segments for n in run]
    return torch.ops.deltamoe_kda.chunk_forward(*args, state, flat, float(scale), bool(use_qk_l2norm), float(eps))
