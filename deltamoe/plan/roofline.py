"""Roofline step times for one chip: decode steps and prefill chunks, with the bound named.

Per step and chip the model charges (spec §3.5-3.7):
- compute: matmul FLOPs per precision / (peak x MFU), attention at BF16;
- HBM: weights touched (non-routed / TP, the experts this chip's tokens hit) + cache reads;
- scale-up and scale-out links: MoE dispatch/combine and TP all-reduces, split by whether
  the peer is inside the scale-up domain (NVLink, UB, ICN) or across it (RDMA NICs);
- fixed: per-layer launch overhead and per-collective latency.
With two-batch overlap (enough tokens per chip) communication partly hides behind compute:
t = max(core, links) + (1 - overlap) x min(core, links) + fixed, core = max(compute, HBM);
otherwise the terms add. `overlap` is a platform efficiency (SGLang measures TBO gains of
25-35 % where perfect hiding would give more: SM sharing and pipeline fill eat the rest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from deltamoe.plan.accelerator import Hardware
from deltamoe.plan.costs import BF16, ModelCosts
from deltamoe.plan.layout import PoolLayout
from deltamoe.plan.precision import COMPUTE_PATHS

TBO_MIN_TOKENS_DECODE = 64  # SGLang: two-batch overlap pays from 64-128 tokens per chip
TBO_MIN_TOKENS_PREFILL = 1024
BOUNDS = ("compute", "HBM", "scale-up link", "scale-out link", "latency")


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    hbm_s: float
    scaleup_s: float
    scaleout_s: float
    fixed_s: float
    overlapped: bool
    compute_dtypes: tuple[str, ...] = ()
    overlap_eff: float = 1.0  # share of the shorter of core/links hidden when overlapped

    @property
    def total_s(self) -> float:
        core = max(self.compute_s, self.hbm_s)
        links = max(self.scaleup_s, self.scaleout_s)
        if self.overlapped:
            return max(core, links) + (1 - self.overlap_eff) * min(core, links) + self.fixed_s
        return core + links + self.fixed_s

    @property
    def bound(self) -> str:
        terms = (self.compute_s, self.hbm_s, self.scaleup_s, self.scaleout_s, self.fixed_s)
        return BOUNDS[max(range(len(terms)), key=lambda i: terms[i])]

    def to_json(self) -> dict[str, Any]:
        return {"total_ms": self.total_s * 1e3, "compute_ms": self.compute_s * 1e3, "hbm_ms": self.hbm_s * 1e3,
                "scaleup_ms": self.scaleup_s * 1e3, "scaleout_ms": self.scaleout_s * 1e3,
                "fixed_ms": self.fixed_s * 1e3, "overlapped": self.overlapped, "bound": self.bound,
                "matmul_dtypes": list(self.compute_dtypes)}


@dataclass(frozen=True)
class Peaks:
    """Matmul peaks (FLOP/s) of the three groups a step runs, chosen from the weight scheme."""

    routed: float
    dense: float
    attention: float
    dtypes: tuple[str, ...]


def peaks(costs: ModelCosts, hw: Hardware) -> Peaks:
    why = f"the compute roofline ({costs.scheme.name} weights)"
    r, rd = hw.peak_tflops(COMPUTE_PATHS[costs.scheme.routed_compute], why)
    d, dd = hw.peak_tflops(COMPUTE_PATHS[costs.scheme.dense_compute], why)
    a, ad = hw.peak_tflops(("bf16",), "attention (BF16 matmuls)")
    return Peaks(r * 1e12, d * 1e12, a * 1e12, (rd, dd, ad))


def fp8_dispatch(hw: Hardware) -> bool:
    return hw.has("fp8_tflops") or hw.has("int8_tops")


def _ep_spread(layout: PoolLayout, hw: Hardware) -> tuple[int, int]:
    """(scale-up domains one EP group spans, EP ranks inside each domain)."""
    domain = hw.scaleup_domain
    n_dom = max(1, math.ceil(layout.ep / domain))
    return n_dom, min(layout.ep, domain)


@dataclass(frozen=True)
class Links:
    scaleup_bytes: float
    scaleout_bytes: float
    collectives_in: int  # collectives that stay inside a domain
    collectives_out: int  # collectives that cross domains


def _moe_traffic(costs: ModelCosts, hw: Hardware, layout: PoolLayout, tokens: float, dedup: bool) -> Links:
    """All-to-all bytes one chip sends for `tokens` tokens over the MoE layers of its stage.

    Decode (DeepEP low-latency) sends one copy per selected expert on another rank. Prefill
    (normal mode) sends one RDMA copy per remote domain, then fans out inside the domain;
    group-limited routing (DeepSeek-V3: 4 of 8 groups) caps the remote domains per token.
    """
    p, cfg = costs.params, costs.cfg
    if layout.ep == 1 or p.n_moe == 0:
        return Links(0.0, 0.0, 0, 0)
    k = p.top_k
    n_dom, per_dom = _ep_spread(layout, hw)
    disp, comb = costs.a2a_bytes_per_copy(fp8_dispatch(hw))
    copy = disp + comb
    if dedup and n_dom > 1:
        remote = (n_dom - 1) * (1 - (1 - 1 / n_dom) ** k)
        if cfg.num_expert_group > 1:
            remote = min(remote, cfg.topk_group)
    else:
        remote = k * (n_dom - 1) / n_dom
    local = k * (per_dom - 1) / layout.ep if n_dom == 1 or not dedup else k * (per_dom - 1) / per_dom
    layers = p.n_moe / layout.pp
    per_tok = layers * copy
    colls = int(round(2 * layers))
    return Links(tokens * local * per_tok, tokens * remote * per_tok,
                 colls if n_dom == 1 else 0, colls if n_dom > 1 else 0)


def _tp_traffic(costs: ModelCosts, layout: PoolLayout, tokens: float) -> Links:
    """Two ring all-reduces per layer (after attention, after the FFN) of the hidden state."""
    if layout.tp == 1:
        return Links(0.0, 0.0, 0, 0)
    layers = costs.cfg.num_hidden_layers / layout.pp
    per_reduce = 2 * (layout.tp - 1) / layout.tp * tokens * costs.cfg.hidden_size * BF16
    return Links(2 * layers * per_reduce, 0.0, int(round(2 * layers)), 0)


def _link_times(hw: Hardware, links: list[Links]) -> tuple[float, float, float]:
    eff = hw.efficiency
    up = sum(x.scaleup_bytes for x in links)
    out = sum(x.scaleout_bytes for x in links)
    t_up = up / (hw.need("scaleup_gbps", "scale-up traffic") * 1e9 * eff.scaleup_eff) if up else 0.0
    t_out = out / (hw.need("scaleout_gbps", "traffic across scale-up domains") * 1e9 * eff.scaleout_eff) if out else 0.0
    lat = (sum(x.collectives_in for x in links) * eff.scaleup_latency_us
           + sum(x.collectives_out for x in links) * eff.scaleout_latency_us) * 1e-6
    return t_up, t_out, lat


def decode_step(costs: ModelCosts, hw: Hardware, layout: PoolLayout, batch: int, context: int,
                tokens_per_seq: int = 1) -> StepTime:
    """One decode step of one pipeline stage on one chip; `batch` sequences per attention rank,
    each verifying `tokens_per_seq` tokens (1 + speculative drafts)."""
    p, w, eff = costs.params, costs.weights, hw.efficiency
    pk = peaks(costs, hw)
    stage = 1 / layout.pp
    n_tok = batch * tokens_per_seq
    group_tokens = n_tok * layout.dp
    experts_here = (p.num_experts + layout.redundant_experts) / layout.ep
    hit = 1 - (1 - p.top_k / p.num_experts) ** group_tokens if p.num_experts else 0.0
    routed = experts_here * hit * costs.expert_bytes * p.n_moe * stage
    dense = (w.attention + w.dense_mlp + w.moe_shared + w.lm_head) / layout.tp * stage
    # Latent KV and indexer keys are replicated on TP ranks; the KDA state is split by heads.
    state = 2 * costs.kda_state_bytes_per_seq
    cache = batch * (costs.decode_cache_read_bytes(context) - state + state / layout.tp) * stage
    hbm_s = (routed + dense + cache) / (hw.need("hbm_tbps", "the decode roofline") * 1e12 * eff.mbu)

    f_routed, f_dense = costs.linear_flops_per_token
    per_chip = n_tok / layout.tp * stage
    compute_s = per_chip * (f_routed / pk.routed + f_dense / pk.dense
                            + costs.attention_flops_decode(context) / pk.attention) / eff.mfu_decode

    dispatched = n_tok / layout.tp  # TP ranks split their replicated tokens before dispatch
    t_up, t_out, lat = _link_times(hw, [_moe_traffic(costs, hw, layout, dispatched, dedup=False),
                                        _tp_traffic(costs, layout, n_tok)])
    fixed = lat + costs.cfg.num_hidden_layers * stage * eff.layer_overhead_us * 1e-6
    return StepTime(compute_s, hbm_s, t_up, t_out, fixed, n_tok >= TBO_MIN_TOKENS_DECODE, pk.dtypes,
                    eff.overlap_eff)


def prefill_step(costs: ModelCosts, hw: Hardware, layout: PoolLayout, chunk: int, context: int) -> StepTime:
    """One prefill chunk of `chunk` tokens per attention rank (prompts of `context` tokens)."""
    p, w, eff = costs.params, costs.weights, hw.efficiency
    pk = peaks(costs, hw)
    stage = 1 / layout.pp
    f_routed, f_dense = costs.linear_flops_per_token
    per_chip = chunk / layout.tp * stage
    compute_s = per_chip * (f_routed / pk.routed + f_dense / pk.dense
                            + costs.attention_flops_prefill(context) / pk.attention) / eff.mfu_prefill
    experts_here = (p.num_experts + layout.redundant_experts) / layout.ep
    dense = (w.attention + w.dense_mlp + w.moe_shared + w.lm_head) / layout.tp
    weights = (experts_here * costs.expert_bytes * p.n_moe + dense) * stage
    acts = 4 * chunk * costs.cfg.hidden_size * BF16 * costs.cfg.num_hidden_layers * stage
    hbm_s = (weights + acts) / (hw.need("hbm_tbps", "the prefill roofline") * 1e12 * eff.mbu)
    t_up, t_out, lat = _link_times(hw, [_moe_traffic(costs, hw, layout, chunk / layout.tp, dedup=True),
                                        _tp_traffic(costs, layout, chunk)])
    fixed = lat + costs.cfg.num_hidden_layers * stage * eff.layer_overhead_us * 1e-6
    return StepTime(compute_s, hbm_s, t_up, t_out, fixed, chunk >= TBO_MIN_TOKENS_PREFILL, pk.dtypes,
                    eff.overlap_eff)


def mixed_step(costs: ModelCosts, hw: Hardware, layout: PoolLayout, batch: int, context: int,
               prefill_tokens: float, tokens_per_seq: int = 1) -> StepTime:
    """A decode step with `prefill_tokens` prompt tokens per attention rank chunked into it
    (colocated serving): the weights are read once, compute and traffic of both add up."""
    dec = decode_step(costs, hw, layout, batch, context, tokens_per_seq)
    if prefill_tokens <= 0:
        return dec
    pre = prefill_step(costs, hw, layout, max(1, round(prefill_tokens)), context)
    acts = 4 * prefill_tokens * costs.cfg.hidden_size * BF16 * costs.cfg.num_hidden_layers / layout.pp
    extra_hbm = acts / (hw.need("hbm_tbps", "the decode roofline") * 1e12 * hw.efficiency.mbu)
    return StepTime(dec.compute_s + pre.compute_s, dec.hbm_s + extra_hbm, dec.scaleup_s + pre.scaleup_s,
                    dec.scaleout_s + pre.scaleout_s, dec.fixed_s, dec.overlapped or pre.overlapped,
                    dec.compute_dtypes, dec.overlap_eff)


def kv_transfer_s(costs: ModelCosts, hw: Hardware, context: int) -> float:
    """Prefill -> decode hand-off of one request's cache over the NIC (spec §3.7)."""
    bw = hw.need("scaleout_gbps", "the prefill -> decode cache transfer") * 1e9 * hw.efficiency.scaleout_eff
    return costs.seq_cache_bytes(context) / bw
