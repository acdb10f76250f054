"""Per decoder layer of `tiny`: how far each converted linear's three products (y = x W^T, dx = dy W,
dW = dy^T x) fall from the fp32 product under bf16 autocast (the reference arm of
bench_train_fp8.py), blockwise fp8 with fp32 around it, and blockwise fp8 inside bf16 autocast (the
fp8 arm). Each linear's input x and output gradient dy come from one fp32 training step of the
randomly initialised model on the docs corpus bench_train_fp8.py trains on, so every form sees the
same operands. (The routed experts' matmuls, the same op on each expert's rows, are left out.)

It answers whether fp8 inside autocast adds error on top of fp8 itself: an fp8 GEMM (scaled_mm)
reads e4m3 operands, accumulates in fp32 and rounds its output once, so fp8 + bf16 should equal the
fp32 quant reference rounded once (checked for every linear and printed) and its error should be
fp8's. Relative error ||approx - exact|| / ||exact|| per product, averaged over a layer's linears.

Run: python bench/fp8_layer_error.py [--rows 8] [--seq-len 64] [--seed 0]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_train_fp8 import layer_errors, write_corpus  # noqa: E402
from common import markdown_table  # noqa: E402

FORMS = ("bf16", "fp8", "fp8+bf16")
PRODUCTS = ("y", "dx", "dW")


def products(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, form: str) -> tuple[torch.Tensor, ...]:
    """(y, dx, dW) of one linear in `form` (fp32 x, w, dy in; the grad enters in y's dtype, as a
    bf16 region hands it back)."""
    from deltamoe.ops.fp8_linear import fp8_linear

    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=form != "fp8"):
        y = fp8_linear(x, w) if form.startswith("fp8") else F.linear(x, w)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, w.grad


def rounded_once(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, fp8_bf16: tuple[torch.Tensor, ...]) -> bool:
    """Whether fp8 + bf16's products are `ops.quant`'s fp32 reference with y rounded once to bf16."""
    from deltamoe.ops.fp8_linear import reference_forward, reference_grads

    y, dx, dw = fp8_bf16
    dx_ref, dw_ref = reference_grads(x, w, dy.to(torch.bfloat16).float())
    return (torch.equal(y, reference_forward(x, w).to(torch.bfloat16)) and torch.equal(dx, dx_ref)
            and torch.allclose(dw, dw_ref, rtol=1e-5, atol=1e-6))


def linear_errors(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple[dict[str, float], bool]:
    """{"form:product": relative error vs fp32} for one linear, and whether fp8 + bf16 rounds once."""
    exact = (x @ w.t(), dy @ w, dy.t() @ x)
    out, once = {}, True
    for form in FORMS:
        got = products(x, w, dy, form)
        out.update({f"{form}:{p}": ((g.float() - e).norm() / e.norm().clamp_min(1e-30)).item()
                    for p, g, e in zip(PRODUCTS, got, exact)})
        if form == "fp8+bf16":
            once = rounded_once(x, w, dy, got)
    return out, once


def captured_operands(rows: int, seq_len: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{linear name: (x, W, dy)} of every linear `--fp8 blockwise` converts, from one fp32 step."""
    from deltamoe.config import load_preset
    from deltamoe.model.load import build_model
    from deltamoe.train.fp8 import Fp8Training

    cfg = load_preset("tiny")
    model = build_model(cfg, seed=seed).train()
    converted = Fp8Training()
    converted(copy.deepcopy(model))  # for the names only: the linears the fp8 run converts
    names = {n for n in converted.stats if not n.endswith(".experts")}
    with tempfile.TemporaryDirectory() as tmp:
        write_corpus(Path(tmp) / "corpus.jsonl")
        blob = (Path(tmp) / "corpus.jsonl").read_bytes()
    start = len(blob) // 2
    ids = torch.tensor(list(blob[start:start + rows * seq_len]), dtype=torch.long).view(rows, seq_len) % cfg.vocab_size
    seen: dict[str, dict[str, torch.Tensor]] = {}

    def keep(name: str):
        def forward_hook(mod, inputs, out):
            seen.setdefault(name, {})["x"] = inputs[0].detach().reshape(-1, inputs[0].shape[-1])

        def backward_hook(mod, grad_in, grad_out):
            seen[name]["dy"] = grad_out[0].detach().reshape(-1, grad_out[0].shape[-1])
        return forward_hook, backward_hook

    modules = dict(model.named_modules())
    for name in names:
        fwd, bwd = keep(name)
        modules[name].register_forward_hook(fwd)
        modules[name].register_full_backward_hook(bwd)
    model(ids, ids).loss.backward()
    return {n: (s["x"].float(), modules[n].weight.detach(), s["dy"].float()) for n, s in seen.items() if "dy" in s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    per_linear, once = {}, []
    for name, (x, w, dy) in sorted(captured_operands(args.rows, args.seq_len, args.seed).items()):
        per_linear[name], ok = linear_errors(x, w, dy)
        once.append(ok)
    by_layer = layer_errors(per_linear)
    columns = [f"{f}:{p}" for f in FORMS for p in PRODUCTS]
    rows = [[layer, *(f"{100 * errs[c]:.2f} %" for c in columns)] for layer, errs in by_layer.items()]
    overall = {c: sum(e[c] for e in per_linear.values()) / len(per_linear) for c in columns}
    rows.append(["all linears", *(f"{100 * overall[c]:.2f} %" for c in columns)])
    print(markdown_table(["layer", *(f"{f} {p}" for f, p in (c.split(":") for c in columns))], rows))
    print(f"fp8 + bf16 equals the fp32 quant reference rounded once: {sum(once)} of {len(once)} linears")


if __name__ == "__main__":
    main()
