"""The compiled decode graph's matvec pass: one-row matmuls become fused reductions, with the
same values as the library matmul; batched rows and `bmm` (attention over the context) stay
library calls."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from deltamoe.serve.engine import compiled_decode
from deltamoe.serve.engine.decode_matvec_pass import DecodeMatvecPass

pytestmark = pytest.mark.skipif(not compiled_decode.compiler_available(),
                                reason="torch.compile's CPU kernels need a C++ compiler")


def _block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, bias: torch.Tensor, keys: torch.Tensor):
    """A decode-shaped block: linear, activation, linear with bias, then 8 heads' pass over cached
    keys (as the DSA indexer's: [1, 8, 5] @ [1, 5, S])."""
    h = torch.nn.functional.silu(x @ w1.t())
    y = torch.nn.functional.linear(h, w2, bias)
    return y, torch.bmm(y.reshape(-1, 8, 5), keys.transpose(1, 2))


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=False,
                         options={"post_grad_custom_post_pass": DecodeMatvecPass()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_matmuls_are_fused_and_equal_the_library_matmul(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 48, generator=g).to(dtype)
    w1, w2 = torch.randn(96, 48, generator=g).to(dtype), torch.randn(40, 96, generator=g).to(dtype)
    bias, keys = torch.randn(40, generator=g).to(dtype), torch.randn(1, 300, 5, generator=g).to(dtype)
    (got, got_scores), (code,) = run_and_get_code(_compiled(_block), x, w1, w2, bias, keys)
    want = _block(x.double(), w1.double(), w2.double(), bias.double(), keys.double())[0]
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the result is rounded to 8 bits once
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    assert torch.allclose(got_scores, torch.bmm(got.reshape(1, 8, 5), keys.transpose(1, 2)), rtol=tol, atol=tol)
    assert "extern_kernels.mm(" not in code and "extern_kernels.addmm(" not in code  # both linears fused
    assert "extern_kernels.bmm(" in code  # the pass over the cached keys stays one library call


def test_batched_rows_keep_the_library_matmul() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 48, generator=g)
    w1, w2, bias = torch.randn(96, 48, generator=g), torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    keys = torch.randn(4, 30, 5, generator=g)
    (got, _), (code,) = run_and_get_code(_compiled(_block), x, w1, w2, bias, keys)
    assert torch.allclose(got, _block(x, w1, w2, bias, keys)[0], rtol=1e-5, atol=1e-5)
    assert "extern_kernels.mm(" in code and "extern_kernels.addmm(" in code
