"""One-row int4 (W4A16) matmul forms on the CPU, side by side: torch's kernel, our one-row kernel
(`ops.int4_matvec`) and Inductor-compiled dequantise-and-reduce expressions, for the shapes of a
`small` decode step.

Which form runs a batch-1 int4 step's weight reads is chosen by this measurement (docs/quantization.md,
"Where a batch-1 int4 decode step's time goes"). Two questions, each answered as a ratio in one run:

- dense projections: `aten._weight_int4pack_mm_for_cpu` at one row (`ops.int4_matmul.int4_matmul`
  with `int4_matvec.turned_off()`), our kernel on the same operand (what `int4_matmul` runs at one
  row), and a compiled expression that reads the same 0.5 byte a weight and unpacks the nibbles inside
  the generated loop. Two layouts: "rows" (each output row's groups contiguous: the reduction runs
  along the row) and "columns" (input-major: the loop vectorises along the output rows, as the
  kernel's own blocked layout does). Both fold the code offset out of the loop: with u = q + 8,
  sum_k x_k s (u_k - 8) = s (sum_k x_k u_k - 8 sum_k x_k) per group.
- routed experts (one token, top-k; and a few rows, `--expert-rows`), each layer's experts in
  one `ExpertOperands` stack: the eager
  step on torch's kernel (`ops.int4_experts.int4_experts_one_token` turned off: the k experts' operands
  gathered, two kernel calls), our kernel reading them in place (two calls, `int4_experts_by_matvec`,
  eager and compiled), and the two forms a compiled graph holds without it, every layer in one graph: the same gather
  and kernel calls (`int4_experts_static(in_place=False)`), and the experts read in place
  (`int4_experts_in_place`: the expert index as indirect indexing inside the generated
  dequantise-and-reduce loops, no [k, 2I, D] copy, no kernel call).

Every layer's weights are distinct (as many as `small` has), so the weight reads come from memory
as they do in a decode step, not from a cache that one repeated matrix stays in; a compiled form
runs every layer in one graph, as a compiled decode step holds them (no per-call entry cost).
Times are this process's CPU time (one torch thread), median of alternating rounds.

    OMP_NUM_THREADS=1 python bench/int4_matvec_forms.py [--rounds 5] [--layers 15] [--experts-only]
                                                        [--expert-rows 1 4]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from deltamoe.config import load_preset
from deltamoe.ops import int4_experts as ie
from deltamoe.ops import int4_matvec
from deltamoe.ops.activations import situ
from deltamoe.ops.int4_matmul import int4_kernel_weight, int4_matmul, int4_matmul_reference
from deltamoe.ops.quant import INT4_GROUP, dequantize_int4, quantize_int4, unpack_nibbles


# ------------------------------------------------------------ layouts of the compiled forms


def offset_codes(packed: torch.Tensor) -> torch.Tensor:
    """u8 [N, K/2] two's-complement nibbles -> int16 [N, K] unsigned codes u = q + 8 (0..15)."""
    return (unpack_nibbles(packed).to(torch.int16) + 8) & 15


def rows_layout(packed: torch.Tensor, group: int) -> torch.Tensor:
    """u8 [N, K/g, g/2]: byte j of a group holds its element j (low nibble) and j + g/2 (high)."""
    n = packed.shape[0]
    codes = offset_codes(packed).view(n, -1, 2, group // 2)
    return (codes[:, :, 0] | (codes[:, :, 1] << 4)).to(torch.uint8).contiguous()


def columns_layout(packed: torch.Tensor, group: int) -> torch.Tensor:
    """`rows_layout` stored input-major: u8 [K/g, g/2, N]."""
    return rows_layout(packed, group).permute(1, 2, 0).contiguous()


def matvec_rows(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x [K/g, 2, g/2] fp32, w u8 [N, K/g, g/2], s fp32 [N, K/g] -> [N]."""
    lo, hi = (w & 15).float(), (w >> 4).float()
    per_group = (lo * x[:, 0] + hi * x[:, 1]).sum(-1) - 8 * x.sum((-1, -2))
    return (per_group * s).sum(-1)


def matvec_columns(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x [K/g, 2, g/2] fp32, w u8 [K/g, g/2, N], s fp32 [K/g, N] -> [N]."""
    lo, hi = (w & 15).float(), (w >> 4).float()
    per_group = (lo * x[:, 0, :, None] + hi * x[:, 1, :, None]).sum(1) - 8 * x.sum((1, 2))[:, None]
    return (per_group * s).sum(0)


# ------------------------------------------------------------------------------- timing


def cpu_us(fn, reps: int) -> float:
    t0 = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - t0) / reps * 1e6


def compare(forms: dict, rounds: int, reps: int) -> dict[str, float]:
    """Median CPU microseconds per call of each form, rounds alternating between the forms."""
    for fn in forms.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(rounds):
        for name, fn in forms.items():
            times[name].append(cpu_us(fn, reps))
    return {name: statistics.median(t) for name, t in times.items()}


def torch_kernel(fn):
    """`fn` run with one-row int4 matmuls on torch's kernel (and compiled graphs traced so)."""
    def run():
        with int4_matvec.turned_off():
            return fn()
    return run


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def dense_shapes(c) -> list[tuple[str, int, int]]:
    """(name, N, K) of a `small` step's int4 projections, joined groups as one matrix."""
    kda = 3 * c.hidden_size + 64 + 64 + c.hidden_size  # q, k, v | f_a | b (padded) | g
    return [("KDA q|k|v|f_a|b|g", kda, c.hidden_size), ("o_proj", c.hidden_size, c.hidden_size),
            ("MoE latent down|shared gate|up", 3 * c.latent_moe_size, c.hidden_size),
            ("latent up", c.hidden_size, c.latent_moe_size),
            ("dense down", c.hidden_size, c.intermediate_size)]


def bench_dense(c, layers: int, rounds: int, group: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, n, k in dense_shapes(c):
        mats = [quantize_int4(torch.randn(n, k, generator=gen) * 0.05, group) for _ in range(layers)]
        kernel_ops = [int4_kernel_weight(p, s, group, row_multiple=64) for p, s in mats]  # as the model pads
        row_w = [(rows_layout(p, group), s.float()) for p, s in mats]
        col_w = [(columns_layout(p, group), s.float().t().contiguous()) for p, s in mats]
        x = torch.randn(1, k, generator=gen).bfloat16()
        xg = x.float().view(-1, 2, group // 2)
        ref = int4_matmul_reference(x, *mats[0], group)[0]

        def kernel_layers(x):
            return [int4_matmul(x, w, s, n, group) for w, s in kernel_ops]

        def rows_layers(xg):
            return [matvec_rows(xg, w, s) for w, s in row_w]

        def columns_layers(xg):
            return [matvec_columns(xg, w, s) for w, s in col_w]

        compiled = {name: torch.compile(fn, dynamic=False) for name, fn in
                    (("ours", kernel_layers), ("rows", rows_layers), ("columns", columns_layers))}
        forms = {"torch's kernel": torch_kernel(lambda: kernel_layers(x)), "our kernel": lambda: kernel_layers(x),
                 "compiled: our kernel": lambda: compiled["ours"](x),
                 "compiled: rows": lambda: compiled["rows"](xg), "compiled: columns": lambda: compiled["columns"](xg)}
        errs = {name: rel_err(fn()[0].reshape(-1), ref) for name, fn in forms.items()}
        us = {f: t / layers for f, t in compare(forms, rounds, 20).items()}
        rows.append({"shape": f"{name} [{n}, {k}]", "us": us, "err": errs})
    return rows


def bench_experts(c, layers: int, rounds: int, group: int, rows: int = 1) -> dict:
    gen = torch.Generator().manual_seed(1)
    e, i, d, k = c.num_experts, c.moe_intermediate_size, c.expert_dim, c.num_experts_per_token

    def q(n, kk):
        return quantize_int4(torch.randn(n, kk, generator=gen) * 0.05, group)

    stacks, first = [], None
    for _ in range(layers):
        w1, w3, w2 = [q(i, d) for _ in range(e)], [q(i, d) for _ in range(e)], [q(d, i) for _ in range(e)]
        stacks.append(ie.ExpertOperands.stack([ie.gate_up_operand(a, b, group) for a, b in zip(w1, w3)],
                                              [ie.down_operand(w, group) for w in w2], ie.kernel_block_rows()))
        first = first or (w1, w3, w2)
    x = torch.randn(rows, d, generator=gen)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(rows)])
    weights = torch.rand(rows, k, generator=gen)

    def one_token():
        return [ie.int4_experts_one_token(x, weights, idx, ops, i, d, group, "situ") for ops in stacks]

    def static_layers(x, weights, idx, in_place):  # every layer in one graph, as a compiled decode step holds them
        return [ie.int4_experts_static(x, weights, idx, ops, i, d, group, "situ", in_place=in_place) for ops in stacks]

    gathered = torch.compile(functools.partial(static_layers, in_place=False), dynamic=False)
    in_place = torch.compile(functools.partial(static_layers, in_place=True), dynamic=False)
    def our_layers(x, weights, idx):  # its own code object: Dynamo's cache is per code object, and the
        return static_layers(x, weights, idx, in_place=True)  # kernel switch is read at trace time only

    ours = torch.compile(our_layers, dynamic=False)
    forms = {"eager: gather + 2 torch kernel calls": torch_kernel(one_token),
             "eager: our kernel in place": one_token} if rows == 1 else {}
    forms.update({"compiled: gather + 2 torch kernel calls": torch_kernel(lambda: gathered(x, weights, idx)),
                  "compiled: in-place expressions": torch_kernel(lambda: in_place(x, weights, idx)),
                  "compiled: our kernel in place": lambda: ours(x, weights, idx)})
    deq = [torch.stack([dequantize_int4(p, s, group, dtype=torch.float32) for p, s in ws]) for ws in first]
    xb = x.bfloat16().float()
    ref = sum(weights[0, j] * (situ(xb[:1] @ deq[0][idx[0, j]].t(), xb[:1] @ deq[1][idx[0, j]].t())
                               @ deq[2][idx[0, j]].t()) for j in range(k))
    errs = {name: rel_err(fn()[0][:1], ref) for name, fn in forms.items()}
    us = {f: t / layers for f, t in compare(forms, rounds, 5).items()}
    return {"shape": f"{rows} row(s), top-{k} of {e} experts, [{2 * i}, {d}] + [{d}, {i}]", "us": us, "err": errs}


def show(row: dict) -> None:
    base = row["us"][next(iter(row["us"]))]
    parts = [f"{f} {t:7.1f} us ({base / t:4.2f}x, err {row['err'][f]:.1e})" for f, t in row["us"].items()]
    print(f"{row['shape']:<48} " + "   ".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=15, help="distinct weights per shape (small: 15 MoE layers)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--experts-only", action="store_true", help="skip the dense projections")
    ap.add_argument("--expert-rows", type=int, nargs="+", default=[1, 4],
                    help="batch rows of the experts' comparison (rows gathering their experts: rows * k < experts)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    c = load_preset(args.preset)
    print("per call, CPU time; (x): the first form's time over this form's (> 1: faster than the first form)")
    for row in [] if args.experts_only else bench_dense(c, args.layers, args.rounds, INT4_GROUP):
        show(row)
    for rows in args.expert_rows:
        show(bench_experts(c, args.layers, args.rounds, INT4_GROUP, rows))


if __name__ == "__main__":
    main()
