"""What each synthetic rank does in one training step, as a list of ops (no times yet).

Ops (tuples):
  ("C", tag, [(kernel name, dur), ...])  compute block on the compute stream; tag F/B/opt
  ("M", dur)                             host-to-device copy of the batch
  ("X", group, kind, xfer, nbytes, async) collective; async ones do not block compute
  ("S", peer, xfer, nbytes)              pipeline send (async on the P2P stream)
  ("R", peer, nbytes)                    pipeline recv (compute waits for it)
  ("SR", peer, xfer, nbytes, peer, nbytes) a send and a recv batched into one kernel (p2p="batched":
                                          torch.distributed.pipelining fuses each send with the recv
                                          that follows it, e.g. forward output + next backward's grad)
  ("W",)                                 compute waits for the communication stream
"""

from __future__ import annotations

import numpy as np

from deltamoe.trace.synth.layout import Layout

GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
FLASH = "flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>"
EXPERT = "void cutlass::device_kernel<grouped_gemm::GroupedGemmKernel<bf16>>(grouped_gemm::Params)"
NORM = "void at::native::vectorized_elementwise_kernel<4, at::native::rms_norm_kernel<c10::BFloat16>>"
ADAM = "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>"

# Base durations (us) for one microbatch of one layer's forward; backward costs twice.
ATTN_US, FLASH_US, NORM_US, EXPERT_US = 260.0, 180.0, 40.0, 320.0
TP_AR_US, A2A_US, P2P_US = 60.0, 90.0, 50.0
BUCKET_US, FINAL_AR_US, OPT_US, H2D_US = 500.0, 300.0, 150.0, 40.0
TOKENS_BYTES = 4096 * 2048 * 2   # tokens x hidden x bf16 per microbatch


def schedule_1f1b(p: int, m: int, s: int) -> list[tuple[str, int]]:
    """Megatron's non-interleaved 1F1B order for stage s: warm-up forwards, steady F/B, cool-down."""
    warm = min(p - s - 1, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    order += [("B", i) for i in range(m - warm, m)]
    return order


def step_program(lay: Layout, rank: int, step: int) -> list[tuple]:
    c = lay.cfg
    s, d, t = lay.coords(rank)
    rng = np.random.default_rng((c.seed, rank, step))
    slow = c.slowdown if rank in c.stragglers else 1.0
    hot = dict(c.hot_ranks)
    ep = lay.member[rank].get("ep")
    ep_ranks = lay.groups[ep][2] if ep is not None else ()
    share = hot.get(rank, 1.0)
    group_share = max([hot.get(r, 1.0) for r in ep_ranks] or [1.0])

    def k(name: str, us: float) -> tuple[str, float]:
        return name, us * slow * max(0.5, 1.0 + c.jitter * rng.standard_normal())

    def layer(mult: float, tag: str) -> list[tuple]:
        ops: list[tuple] = [("C", tag, [k(NORM, NORM_US * mult), k(GEMM, ATTN_US * mult),
                                        k(FLASH, FLASH_US * mult)])]
        if c.tp > 1:
            ops.append(("X", lay.group(rank, "tp"), "all_reduce", TP_AR_US, TOKENS_BYTES, False))
        if ep is not None:
            a2a_bytes = int(TOKENS_BYTES * share)
            ops.append(("X", ep, "all_to_all", A2A_US * group_share, a2a_bytes, False))
            ops.append(("C", tag, [k(EXPERT, EXPERT_US * mult * share)]))
            ops.append(("X", ep, "all_to_all", A2A_US * group_share, a2a_bytes, False))
        else:
            ops.append(("C", tag, [k(GEMM, EXPERT_US * mult)]))
        return ops

    prog: list[tuple] = [("M", H2D_US)]
    order = schedule_1f1b(c.pp, c.m, s) if c.pp > 1 else [(x, i) for i in range(c.m) for x in "FB"]
    prev = lay.rank_of(s - 1, d, t) if s > 0 else -1
    nxt = lay.rank_of(s + 1, d, t) if s < c.pp - 1 else -1
    last_b = max(i for i, (x, _) in enumerate(order) if x == "B")
    for i, (kind, _mb) in enumerate(order):
        if kind == "F":
            if prev >= 0:
                prog.append(("R", prev, TOKENS_BYTES))
            for _ in range(c.layers):
                prog += layer(1.0, "F")
            if nxt >= 0:
                prog.append(("S", nxt, P2P_US, TOKENS_BYTES))
        else:
            if nxt >= 0:
                prog.append(("R", nxt, TOKENS_BYTES))
            for li in range(c.layers):
                prog += layer(2.0, "B")
                if i == last_b and li == (c.layers - 1) // 2 and c.dp > 1:
                    # DDP-style bucket: the first gradients sync while backward continues.
                    prog.append(("X", lay.group(rank, "dp"), "all_reduce", BUCKET_US, 64 << 20, True))
            if prev >= 0:
                prog.append(("S", prev, P2P_US, TOKENS_BYTES))
    if c.dp > 1:
        prog.append(("X", lay.group(rank, "dp"), "all_reduce", FINAL_AR_US, 32 << 20, False))
    prog.append(("W",))
    if c.p2p == "batched":
        prog = _batch_send_recv(prog)
    prog.append(("C", "opt", [k(ADAM, OPT_US), k(ADAM, OPT_US)]))
    return prog


def _batch_send_recv(prog: list[tuple]) -> list[tuple]:
    """A send directly followed by a recv becomes one batched op, as Schedule1F1B issues them."""
    out: list[tuple] = []
    for op in prog:
        if op[0] == "R" and out and out[-1][0] == "S":
            out[-1] = ("SR", *out[-1][1:], *op[1:])
        else:
            out.append(op)
    return out
