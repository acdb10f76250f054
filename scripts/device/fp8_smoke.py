"""GPU smoke check of blockwise FP8 training (run when a CUDA device is lent; a few seconds).

1. `blockwise_fp8_mm` through `torch.nn.functional.scaled_mm` (sm90+) against the exact CPU emulation,
   for the three tilings training uses (1x128 x 128x128 forward/dgrad, 1x128 x 1x128 wgrad).
2. `fp8_linear` forward + backward on the GPU against the same on the CPU (emulation).
3. Three training steps of the `tiny` preset with `--fp8 blockwise` and bf16 autocast: finite losses.
Exit status 0 when all pass; prints one line per check.
    python scripts/device/fp8_smoke.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deltamoe.ops.fp8_linear import ACT_TILE, WEIGHT_BLOCK, blockwise_fp8_mm, fp8_linear, quantize_tiles, uses_kernel  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}, "
          f"kernel path: {uses_kernel(dev)}")
    ok = True
    g = torch.Generator().manual_seed(0)
    m, k, n = 256, 512, 384
    a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.02
    for block in (WEIGHT_BLOCK, ACT_TILE):
        cpu = blockwise_fp8_mm(quantize_tiles(a, ACT_TILE), quantize_tiles(b, block))
        try:
            gpu = blockwise_fp8_mm(quantize_tiles(a.to(dev), ACT_TILE), quantize_tiles(b.to(dev), block))
            err = rel(gpu, cpu)
            good = err < 1e-5
        except Exception as e:  # report and continue with the other checks
            err, good = f"{type(e).__name__}: {e}", False
        ok &= good
        print(f"[{'ok' if good else 'FAIL'}] scaled_mm 1x128 x {block[0]}x{block[1]} vs emulation: rel err {err}")
    x = torch.randn(4, 64, k, generator=g, requires_grad=True)
    w = (torch.randn(n, k, generator=g) * 0.02).requires_grad_()
    dy = torch.randn(4, 64, n, generator=g)
    fp8_linear(x, w).backward(dy)
    xg, wg = x.detach().to(dev).requires_grad_(), w.detach().to(dev).requires_grad_()
    y = fp8_linear(xg, wg)
    y.backward(dy.to(dev))
    errs = {"y": rel(y, fp8_linear(x.detach(), w.detach())), "dx": rel(xg.grad, x.grad), "dw": rel(wg.grad, w.grad)}
    good = all(e < 1e-5 for e in errs.values())
    ok &= good
    print(f"[{'ok' if good else 'FAIL'}] fp8_linear forward/backward GPU vs CPU emulation: {errs}")
    from deltamoe.train.config import TrainConfig
    from deltamoe.train.trainer import train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig.from_dict({"model": {"preset": "tiny"}, "run": {
            "out": tmp, "steps": 3, "fp8": "blockwise", "precision": "bf16", "eval_every": 0, "progress": False}})
        result = train(cfg.validate())
    losses = [r["loss"] for r in result.metrics]
    good = all(torch.isfinite(torch.tensor(losses)))
    ok &= good
    print(f"[{'ok' if good else 'FAIL'}] tiny, 3 steps, --fp8 blockwise --precision bf16: losses {losses}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
