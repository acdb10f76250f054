"""One-row INT4 (W4A16) matmuls through a small C++ kernel of our own (`csrc/int4_matvec.cpp`).

At one row (a decode step at batch 1) torch's CPU int4 kernel is bound by unpacking nibbles,
not by the weight bytes, and the routed experts first gather the selected experts' operands
into one copy. This kernel reads the very operand torch's converter made
(`ops.int4_matmul.int4_kernel_weight`: blocks of B output rows stored K-major, layout checked by
`ops.int4_experts.kernel_layout_readable`), so no second copy of any weight is kept: rows > 1
(prefill, larger batches) still run torch's kernel on the same bytes. A stack of experts is read
in place through strides (`expert_matvec`), one output row per (row, selected expert).

The contract is torch's kernel's (W4A16): bf16 activations in (the callers round them), fp32
accumulation, and the callers round the output as torch's kernel would; only the order of the
fp32 sums differs. `matvec_reference` is the readable form, on the dequantised weight.

The kernel is compiled on first use with `torch.utils.cpp_extension` (g++ and ninja, cached
under torch's extensions folder) with AVX2 + FMA where the CPU has them. Without a compiler,
without AVX2, or with `DELTAMOE_INT4_MATVEC=0` it is not used and torch's kernel runs instead
(same contract); `available()` says which, and `status()` why.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from deltamoe.ops.cpp_build import cpu_has_avx2, kernel_status, load_cpp_extension
from deltamoe.ops.quant import dequantize_int4

SOURCE = Path(__file__).parent / "csrc" / "int4_matvec.cpp"
ENV_SWITCH = "DELTAMOE_INT4_MATVEC"  # "0" turns the kernel off (A/B runs, a suspect build)


@functools.cache
def _cpu_has_avx512_bf16() -> bool:
    """Whether this CPU runs AVX512-BF16 (`vdpbf16ps`) and VBMI (`vpermb`), read from the kernel's CPU flags (Linux)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512vbmi"} <= flags
    except OSError:
        pass
    return False


@functools.cache
def _build() -> str | None:
    """Compile and load the extension; None when it loaded, else why not."""
    flags = ["-O3", "-mavx2", "-mfma"] if cpu_has_avx2() else ["-O3"]
    if _cpu_has_avx512_bf16():
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vbmi"]
    # (-fopenmp, added by the builder, matters here: the int4 step at 2 threads measured 0.95x bf16
    # without it, 1.34x with.)
    why = load_cpp_extension("deltamoe_int4_matvec", SOURCE, flags)
    if why is not None:
        return why
    torch.library.register_fake("deltamoe_int4::matvec")(_matvec_fake)
    return None


def _matvec_fake(x, w, s, experts, rows, block, group, w_strides, s_strides, vector):
    return x.new_empty((experts.shape[0], rows), dtype=torch.float32)


@functools.cache
def status() -> str:
    """'on', or why the kernel is not used here."""
    from deltamoe.ops.int4_experts import kernel_block_rows, kernel_layout_readable

    def unsupported() -> str | None:
        if not kernel_layout_readable():
            return "torch's int4 operand layout is not the one this kernel reads"
        if kernel_block_rows() not in (32, 64):
            return f"block of {kernel_block_rows()} rows"
        return None

    return kernel_status("int4 matvec kernel", ENV_SWITCH, _build, "torch's int4 kernel", unsupported)


def available() -> bool:
    """Whether one-row int4 matmuls run this kernel (else torch's)."""
    return status() == "on"


# Resolved once, eagerly (int4 modules call `one_row_block` as they load). A compiled graph reads
# this global, so Dynamo guards on its value: `turned_off` makes a graph traced with the kernel
# trace again (graphs are shared between models of one shape: `compile_for_decode`).
_one_row_block: int | None = None


def one_row_block() -> int:
    """The operand's block rows when one-row matmuls run this kernel, else 0 (torch's kernel runs)."""
    global _one_row_block
    if _one_row_block is None and torch.compiler.is_compiling():
        return 0  # never build inside a graph's tracing (no int4 module loaded: nothing to build for)
    if _one_row_block is None:
        from deltamoe.ops.int4_experts import kernel_block_rows

        _one_row_block = kernel_block_rows() if available() else 0
    return _one_row_block


@contextlib.contextmanager
def turned_off():
    """Inside the block one-row int4 matmuls run torch's kernel (and the in-place expressions), as
    where this kernel is not built: the tests compare both, and A/B runs time both in one process
    (a compiled graph traces again for the other form: Dynamo guards on the switch)."""
    global _one_row_block
    saved = one_row_block()
    _one_row_block = 0
    try:
        yield
    finally:
        _one_row_block = saved


def build() -> bool:
    """Compile the kernel now (setup scripts do, so the first decode step does not); whether it loaded."""
    return _build() is None


_ONE_SELECTION = torch.zeros(1, dtype=torch.long)  # a dense matvec's one "expert" (made once, not per call)


def _call(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, experts: torch.Tensor, rows: int, block: int,
          group: int, w_strides: tuple[int, int], s_strides: tuple[int, int, int], vector: bool = True) -> torch.Tensor:
    return torch.ops.deltamoe_int4.matvec.default(x, weight, scale, experts, rows, block, group, w_strides,
                                                  s_strides, vector)


def matvec(x: torch.Tensor, weight: torch.Tensor, scales_and_zeros: torch.Tensor, rows: int, block: int,
           group: int, vector: bool = True) -> torch.Tensor:
    """x [M, K] (each row its own matvec; M small) @ W^T -> fp32 [M, rows], W in torch's operand
    layout (u8 [N', K/2] with N' >= rows a multiple of `block`; scales_and_zeros bf16 [K/g, N', 2]).
    `vector=False` runs the kernel's plain C++ path (the tests compare both)."""
    n_op, m = weight.shape[0], x.shape[0]
    if x.shape[-1] != 2 * weight.shape[1]:
        raise ValueError(f"x: expected {2 * weight.shape[1]} columns (the operand's input width), got {x.shape[-1]}")
    # One selection per row of x: the "expert" is the one operand, stride 0.
    experts = _ONE_SELECTION if m == 1 else torch.zeros(m, dtype=torch.long)
    return _call(x, weight, scales_and_zeros, experts, rows, block, group, (0, weight.shape[1] * block),
                 (0, 2 * n_op, 2), vector)


def expert_matvec(x: torch.Tensor, weight: torch.Tensor, scales_and_zeros: torch.Tensor, experts: torch.Tensor,
                  rows: int, block: int, group: int, w_strides: tuple[int, int], s_strides: tuple[int, int, int],
                  vector: bool = True) -> torch.Tensor:
    """Selection r: x[r] (or x[0] for all when x has one row) times expert `experts[r]`'s operand,
    read from the stack `weight` / `scales_and_zeros` through their strides -> fp32 [R, rows]."""
    return _call(x, weight, scales_and_zeros, experts, rows, block, group, w_strides, s_strides, vector)


def codes_of(weight: torch.Tensor, block: int) -> torch.Tensor:
    """torch's u8 operand [N', K/2] -> the signed codes int32 [N', K] it holds (the readable layout)."""
    from deltamoe.ops.int4_experts import kernel_codes

    return kernel_codes(weight, block) - 8


def matvec_reference(x: torch.Tensor, weight: torch.Tensor, scales_and_zeros: torch.Tensor, rows: int, block: int,
                     group: int) -> torch.Tensor:
    """`matvec` written out: the operand's codes times its group scales, an fp32 matmul -> fp32 [M, rows]."""
    codes = codes_of(weight, block)[:rows].float()
    scale = scales_and_zeros[:, :rows, 0].t().float()  # [rows, K/g]
    w = codes * scale.repeat_interleave(group, dim=1)
    return x.float() @ w.t()


def dequantized_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """The same product from the checkpoint's own form (u8 nibbles [N, K/2], bf16 scale [N, K/g])."""
    return x.float() @ dequantize_int4(packed, scale, group, dtype=torch.float32).t()
