"""bench/fp8_layer_error.py's per-linear comparison: fp8 inside bf16 autocast has fp8's own error
(the product rounded once), bf16 autocast an order of magnitude less."""

import importlib.util
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_fp8_inside_autocast_errs_as_fp8_alone_and_rounds_once():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("fp8_layer_error", BENCH / "fp8_layer_error.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(96, 256, generator=g), torch.randn(96, 192, generator=g)
    w = torch.randn(192, 256, generator=g) * 0.05
    errs, once = module.linear_errors(x, w, dy)
    assert once
    assert set(errs) == {f"{f}:{p}" for f in module.FORMS for p in module.PRODUCTS}
    for p in module.PRODUCTS:
        assert 0.001 < errs[f"bf16:{p}"] < 0.005  # bf16: 8 mantissa bits
        assert 0.02 < errs[f"fp8:{p}"] < 0.06  # e4m3: 3 mantissa bits
        assert abs(errs[f"fp8+bf16:{p}"] - errs[f"fp8:{p}"]) < 0.002  # the one bf16 rounding adds ~nothing
