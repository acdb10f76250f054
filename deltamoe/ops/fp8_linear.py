"""Blockwise-FP8 linear for training (DeepSeek-V3 recipe): e4m3 operands with fp32 tile scales,
fp32 accumulation, in the forward and in both backward matmuls.

Every matmul here is `a @ b.T` with both operands quantised in tiles along the contraction
dim K, as an fp8 tensor-core GEMM with per-block scaling needs:

    forward   y  = x  @ W.T     x  in 1 x 128 tiles (per token),  W in 128 x 128 blocks
    dgrad     dx = dy @ W       dy in 1 x 128 tiles (per token),  W in 128 x 128 blocks (W.T's blocks
                                                                  are W's blocks transposed)
    wgrad     dW = dy.T @ x     dy in 128 x 1 tiles (128 tokens), x in 128 x 1 tiles (128 tokens)

The forward keeps x only as its e4m3 1 x 128 copy (one byte an element); wgrad dequantises it and
requantises it in 128 x 1 tiles, the 1x128 -> 128x1 conversion DeepSeek-V3 describes (on a CPU
the copy holds the e4m3 values as fp32, see `Fp8Tiles`). dgrad reuses the forward's W blocks,
transposed (W.T's blocks are W's blocks transposed: the same values as requantising W.T). Master
weights, gradients and optimizer state stay in full precision.

`blockwise_fp8_mm` is the one place a product is taken: on a CPU (and anywhere the kernel does
not apply) it is the exact emulation dequantise -> fp32 matmul of `ops.quant`'s functions; on a
GPU with blockwise-scaled `torch.nn.functional.scaled_mm` (sm90+) it is that kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from deltamoe.ops.autocast import without_autocast
from deltamoe.ops.fp8_emulation import dequantize_fp8_blockwise_fp32, quantize_fp8_blockwise_fp32
from deltamoe.ops.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise

ACT_TILE = (1, 128)  # activations and output gradients along K
WEIGHT_BLOCK = (128, 128)


@dataclass
class Fp8Tiles:
    """A 2-D tensor of e4m3 values with one fp32 scale per `block` tile (`ops.quant` layout).

    `data` holds the values as float8_e4m3fn on CUDA (what the kernel reads) and as fp32 elsewhere
    (`ops.fp8_emulation`: the same values, without a CPU's slow float8 -> fp32 conversion). The
    dequantised tensor is kept after the first `dequantize`, so the product and the error statistics
    share it."""

    data: torch.Tensor  # float8_e4m3fn or fp32 [R, C]
    scale: torch.Tensor  # fp32 [ceil(R / br), ceil(C / bc)]
    block: tuple[int, int]
    _dequantized: torch.Tensor | None = field(default=None, repr=False)

    def dequantize(self) -> torch.Tensor:
        if self._dequantized is None:
            if self.data.dtype == torch.float32:
                self._dequantized = dequantize_fp8_blockwise_fp32(self.data, self.scale, self.block)
            else:
                self._dequantized = dequantize_fp8_blockwise(self.data, self.scale, self.block, dtype=torch.float32)
        return self._dequantized


def quantize_tiles(t: torch.Tensor, block: tuple[int, int]) -> Fp8Tiles:
    """float [R, C] -> e4m3 tiles of shape `block`; edge tiles of a size not a multiple are partial."""
    quantize = quantize_fp8_blockwise if t.is_cuda else quantize_fp8_blockwise_fp32
    data, scale = quantize(t, block)
    return Fp8Tiles(data, scale, block)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """||approx - exact|| / ||exact|| in fp32 (0 for an all-zero `exact`), as a 0-d tensor."""
    exact = exact.float()
    return (approx - exact).norm() / exact.norm().clamp_min(1e-30)


# ----------------------------------------------------------------------------- product


def _kernel_applies(a: Fp8Tiles, b: Fp8Tiles) -> bool:
    """Blockwise scaled_mm runs on sm90+ CUDA with K and both outer dims multiples of 128 (full tiles)."""
    if not a.data.is_cuda or not hasattr(F, "scaled_mm") or torch.cuda.get_device_capability(a.data.device) < (9, 0):
        return False
    (m, k), n = a.data.shape, b.data.shape[0]
    return k % 128 == 0 and m % 128 == 0 and n % 128 == 0


def _scaling(block: tuple[int, int]):
    return F.ScalingType.BlockWise1x128 if block == ACT_TILE else F.ScalingType.BlockWise128x128


def _kernel_mm(a: Fp8Tiles, b: Fp8Tiles, out_dtype: torch.dtype) -> torch.Tensor:
    # The layouts torch's own scaled_mm samples use: mat_b column-major ([K, N] as a transposed
    # row-major [N, K]); 1x128 scales outer-dim-major ([rows, K/128] with rows contiguous); a
    # 128x128 scale of B as [K/128 rounded up to 4, N/128], stored N/128-major.
    def outer_major(scale: torch.Tensor) -> torch.Tensor:
        return scale.t().contiguous().t()

    if b.block == ACT_TILE:
        b_scale = outer_major(b.scale)
    else:
        k_blocks = b.scale.shape[1]
        b_scale = F.pad(b.scale, (0, -k_blocks % 4)).t()
    return F.scaled_mm(a.data, b.data.t(), outer_major(a.scale), _scaling(a.block), b_scale, _scaling(b.block),
                       output_dtype=out_dtype)


def blockwise_fp8_mm(a: Fp8Tiles, b: Fp8Tiles, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a @ b.T over e4m3 tiles, accumulated in fp32: [M, K] x [N, K] -> [M, N] in `out_dtype`.

    `a` is always in 1 x 128 tiles along K; `b` in 128 x 128 blocks (a weight) or 1 x 128 tiles along
    K (wgrad's second activation operand).
    """
    if a.block != ACT_TILE:
        raise ValueError(f"a: expected {ACT_TILE} tiles along K, got {a.block}")
    if _kernel_applies(a, b):
        return _kernel_mm(a, b, out_dtype)
    with without_autocast(a.data.device.type):
        return (a.dequantize() @ b.dequantize().t()).to(out_dtype)


def uses_kernel(device: torch.device) -> bool:
    """Whether `blockwise_fp8_mm` takes the scaled_mm kernel on this device for full 128-tiles."""
    return (device.type == "cuda" and hasattr(F, "scaled_mm")
            and torch.cuda.get_device_capability(device) >= (9, 0))


# ---------------------------------------------------------------------------- autograd


class Fp8ErrorStats:
    """Running sums of the relative quantisation error of one linear's operands (x, W, dy), kept as
    tensors so recording never syncs with the host; `take` returns the means and resets."""

    KINDS = ("x", "w", "dy")

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None
        self.counts = [0, 0, 0]
        self.enabled = True  # off: the linear records nothing (the error costs as much as a quantisation)

    def add(self, kind: str, err: torch.Tensor) -> None:
        i = self.KINDS.index(kind)
        if self.sums is None:
            self.sums = torch.zeros(3, dtype=torch.float32, device=err.device)
        self.sums[i] += err.detach().float()
        self.counts[i] += 1

    def take(self) -> dict[str, float]:
        if self.sums is None:
            return {}
        sums = self.sums.tolist()
        out = {k: s / n for k, s, n in zip(self.KINDS, sums, self.counts) if n}
        self.sums, self.counts = None, [0, 0, 0]
        return out


class Fp8BlockwiseLinear(torch.autograd.Function):
    """y = x @ W.T with every product blockwise-fp8 (see the module docstring for the tiling)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, stats: Fp8ErrorStats | None) -> torch.Tensor:
        out_dtype = (torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type)
                     else x.dtype)
        x2 = x.reshape(-1, x.shape[-1])
        xq = quantize_tiles(x2, ACT_TILE)
        wq = quantize_tiles(weight, WEIGHT_BLOCK)
        y = blockwise_fp8_mm(xq, wq, out_dtype)
        if stats is not None and stats.enabled:
            stats.add("x", relative_error(xq.dequantize(), x2))
            stats.add("w", relative_error(wq.dequantize(), weight))
        ctx.save_for_backward(xq.data, xq.scale, wq.data, wq.scale)
        ctx.stats, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = stats, x.shape, x.dtype, weight.dtype
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x_data, x_scale, w_data, w_scale = ctx.saved_tensors
        dy = grad.reshape(-1, grad.shape[-1])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dyq = quantize_tiles(dy, ACT_TILE)
            if ctx.stats is not None and ctx.stats.enabled:
                ctx.stats.add("dy", relative_error(dyq.dequantize(), dy))
            # W.T's 128 x 128 blocks are W's blocks transposed: the forward's tiles, transposed.
            wq_t = Fp8Tiles(w_data.t().contiguous(), w_scale.t().contiguous(), WEIGHT_BLOCK)
            dx = blockwise_fp8_mm(dyq, wq_t, torch.float32)
            dx = dx.reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            x_back = Fp8Tiles(x_data, x_scale, ACT_TILE).dequantize()  # the forward's e4m3 copy of x
            dw = blockwise_fp8_mm(quantize_tiles(dy.t(), ACT_TILE), quantize_tiles(x_back.t(), ACT_TILE),
                                  torch.float32).to(ctx.w_dtype)
        return dx, dw, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, stats: Fp8ErrorStats | None = None) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias) computed in blockwise fp8, forward and backward."""
    return Fp8BlockwiseLinear.apply(x, weight, stats)


def reference_forward(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = deq(q_1x128(x)) @ deq(q_128x128(W)).T in fp32."""
    xq, xs = quantize_fp8_blockwise(x2, ACT_TILE)
    wq, ws = quantize_fp8_blockwise(weight, WEIGHT_BLOCK)
    return dequantize_fp8_blockwise(xq, xs, ACT_TILE, torch.float32) @ \
        dequantize_fp8_blockwise(wq, ws, WEIGHT_BLOCK, torch.float32).t()


def reference_grads(x2: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dW) with dgrad on (dy 1x128, W 128x128) and wgrad on (dy 128x1, x 128x1 from x's 1x128 copy)."""
    def qdq(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
        return dequantize_fp8_blockwise(*quantize_fp8_blockwise(t, block), block, torch.float32)

    dx = qdq(dy, ACT_TILE) @ qdq(weight, WEIGHT_BLOCK)
    dw = qdq(dy, (128, 1)).t() @ qdq(qdq(x2, ACT_TILE), (128, 1))
    return dx, dw
