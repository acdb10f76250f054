"""Layout search: every TP/DP/PP shape and prefill/decode split that fits, ranked by
output tokens/s per chip under the latency SLO.

For each pool size the best layout is found independently (memoized): a decode pool takes
the largest batch per attention rank that fits memory and meets TPOT; a prefill pool runs
fixed chunks and must meet TTFT. A disaggregated plan balances the two pools' request
rates; a colocated ("mixed") plan chunks the prompts into the decode steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from deltamoe.errors import ConfigError
from deltamoe.plan.accelerator import Hardware
from deltamoe.plan.costs import ModelCosts
from deltamoe.plan.layout import PoolLayout, layout_candidates
from deltamoe.plan.precision import COMPUTE_PATHS
from deltamoe.plan.roofline import StepTime, decode_step, kv_transfer_s, mixed_step, prefill_step

BATCH_GRID = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
GB = 1e9
# A pool of up to this many prefill/decode split points tries every one (every documented example
# does); a larger pool (e.g. --nodes 1000) searches a grid of about this many points and refines it
# around the best one, level by level, down to single split units.
SPLIT_POINTS = 64
MAX_CHIPS = 1_000_000  # --nodes/--chips above this: a one-line error (no deployment is that large)
FIT_SEARCH_COUNTS = 4096  # chip counts tried upward for the "does not fit" hint


@dataclass(frozen=True)
class Workload:
    context: int = 8192  # prompt tokens per request
    output: int = 1024  # generated tokens per request
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    draft_tokens: int = 0  # speculative tokens verified per step
    accept_len: float = 1.0  # tokens accepted per step (1 without speculation)
    prefill_chunk: int = 8192  # prompt tokens per attention rank per prefill step
    headroom: float = 0.10  # fraction of memory kept free
    workspace_gb: float = 4.0  # runtime, graphs, communication buffers per chip
    state_slots: int = 1  # KDA state slots per sequence (prefix-cache checkpoints, spec rollback)

    @property
    def decode_context(self) -> int:
        """Mean cache length over a request's decode."""
        return self.context + self.output // 2

    @property
    def tokens_per_seq(self) -> int:
        return 1 + self.draft_tokens


@dataclass(frozen=True)
class MemoryUse:
    weights: float
    cache: float
    activations: float
    workspace: float
    capacity: float  # usable bytes: memory x (1 - headroom)

    @property
    def total(self) -> float:
        return self.weights + self.cache + self.activations + self.workspace

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def to_json(self) -> dict[str, float]:
        return {k: round(v / GB, 3) for k, v in (("weights_gb", self.weights), ("cache_gb", self.cache),
                ("activations_gb", self.activations), ("workspace_gb", self.workspace),
                ("total_gb", self.total), ("usable_gb", self.capacity))}


@dataclass(frozen=True)
class PoolEstimate:
    layout: PoolLayout
    step: StepTime
    batch: int  # decode: sequences per attention rank; prefill: chunk tokens per rank
    memory: MemoryUse
    tokens_per_s: float  # whole pool: output tok/s (decode, mixed) or prompt tok/s (prefill)
    latency_s: float  # TPOT (decode, mixed) or TTFT without transfer (prefill)

    @property
    def per_chip(self) -> float:
        return self.tokens_per_s / self.layout.chips

    def to_json(self) -> dict[str, Any]:
        key = "tpot_ms" if self.layout.role != "prefill" else "ttft_ms"
        size = "seqs_per_rank" if self.layout.role != "prefill" else "chunk_tokens_per_rank"
        return {"layout": self.layout.to_json(), size: self.batch, "step": self.step.to_json(),
                "memory_per_chip": self.memory.to_json(), "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_per_chip": self.per_chip, key: self.latency_s * 1e3}


@dataclass(frozen=True)
class Plan:
    mode: str  # "disaggregated" | "colocated"
    chips: int
    prefill: PoolEstimate | None
    decode: PoolEstimate
    requests_per_s: float
    ttft_s: float
    tpot_s: float
    workload: Workload

    @property
    def output_per_chip(self) -> float:
        return self.requests_per_s * self.workload.output / self.chips

    @property
    def total_per_chip(self) -> float:
        return self.requests_per_s * (self.workload.context + self.workload.output) / self.chips

    def meets(self) -> bool:
        w = self.workload
        return (w.slo_ttft_s is None or self.ttft_s <= w.slo_ttft_s) and \
            (w.slo_tpot_s is None or self.tpot_s <= w.slo_tpot_s)


class Planner:
    def __init__(self, costs: ModelCosts, hw: Hardware, workload: Workload, model_name: str = ""):
        self.costs, self.hw, self.w = costs, hw, workload
        self.model_name = model_name or costs.cfg.model_type
        self.mem_bytes = hw.need("mem_gb", "the memory check") * GB
        self.capacity = self.mem_bytes * (1 - workload.headroom)
        self.decode_pool = lru_cache(maxsize=None)(self._decode_pool)
        self.prefill_pool = lru_cache(maxsize=None)(self._prefill_pool)
        self.mixed_pool = lru_cache(maxsize=None)(self._mixed_pool)
        # A step's time depends on the instance's shape, never on how many replicas a pool has, so
        # pools of different sizes share one estimate per shape (what keeps large pools fast).
        self._steps: dict[tuple, StepTime] = {}

    def _step(self, fn, layout: PoolLayout, *args) -> StepTime:
        key = (fn, replace(layout, replicas=1), args)
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = fn(self.costs, self.hw, layout, *args)
        return step

    # ---------------------------------------------------------------- memory
    def _memory(self, layout: PoolLayout, seqs: int, cache_tokens: int, act_tokens: int) -> MemoryUse:
        c = self.costs
        weights = c.weights_per_chip(layout.tp, layout.ep, layout.pp, layout.redundant_experts)
        # Latent KV and indexer keys are replicated on TP ranks; the KDA state is split by heads.
        per_seq_state = c.kda_state_bytes_per_seq * self.w.state_slots / layout.tp
        cache = seqs * (cache_tokens * c.kv_bytes_per_token + per_seq_state)
        acts = c.prefill_activation_bytes(act_tokens, layout.tp) if act_tokens else 0.0
        return MemoryUse(weights, cache, acts, self.w.workspace_gb * GB, self.capacity)

    def max_batch(self, layout: PoolLayout, context: int, act_tokens: int = 0) -> int:
        base = self._memory(layout, 0, 0, act_tokens)
        per_seq = self._memory(layout, 1, context, 0).cache
        free = base.capacity - base.total
        return max(0, int(free // per_seq)) if free > 0 else 0

    # ----------------------------------------------------------------- pools
    def _decode_pool(self, chips: int, role: str = "decode") -> PoolEstimate | None:
        w, best = self.w, None
        ctx = w.decode_context
        for layout in layout_candidates(self.costs.cfg, self.hw, chips, role):
            bmax = self.max_batch(layout, ctx)
            for b in [x for x in BATCH_GRID if x < bmax] + ([bmax] if bmax else []):
                step = self._step(decode_step, layout, b, ctx, w.tokens_per_seq)
                tpot = step.total_s * layout.pp / w.accept_len
                if w.slo_tpot_s is not None and tpot > w.slo_tpot_s:
                    break  # bigger batches are only slower
                rate = b * layout.attention_ranks * w.accept_len / step.total_s
                if best is None or rate > best.tokens_per_s:
                    best = PoolEstimate(layout, step, b, self._memory(layout, b, ctx, 0), rate, tpot)
        return best

    def _prefill_pool(self, chips: int) -> PoolEstimate | None:
        w, best = self.w, None
        chunk = min(w.prefill_chunk, w.context) if w.context > 0 else w.prefill_chunk
        for layout in layout_candidates(self.costs.cfg, self.hw, chips, "prefill"):
            seqs = max(1, math.ceil(chunk / max(1, w.context)))
            mem = self._memory(layout, seqs, min(chunk, w.context), chunk)
            if not mem.fits:
                continue
            step = self._step(prefill_step, layout, chunk, w.context)
            ttft = (math.ceil(w.context / chunk) + layout.pp - 1) * step.total_s
            if w.slo_ttft_s is not None and ttft > w.slo_ttft_s:
                continue
            rate = chunk * layout.attention_ranks / step.total_s
            if best is None or rate > best.tokens_per_s:
                best = PoolEstimate(layout, step, chunk, mem, rate, ttft)
        return best

    def _mixed_pool(self, chips: int) -> PoolEstimate | None:
        """Colocated serving: each decode step carries batch x ISL/OSL prompt tokens per rank."""
        w, best = self.w, None
        ctx, ratio = w.decode_context, w.context / max(1, w.output)
        for layout in layout_candidates(self.costs.cfg, self.hw, chips, "mixed"):
            bmax = self.max_batch(layout, ctx, act_tokens=w.prefill_chunk)
            for b in [x for x in BATCH_GRID if x < bmax] + ([bmax] if bmax else []):
                step = self._step(mixed_step, layout, b, ctx, b * ratio / w.accept_len, w.tokens_per_seq)
                tpot = step.total_s * layout.pp / w.accept_len
                if w.slo_tpot_s is not None and tpot > w.slo_tpot_s:
                    break
                rate = b * layout.attention_ranks * w.accept_len / step.total_s
                if best is None or rate > best.tokens_per_s:
                    best = PoolEstimate(layout, step, b, self._memory(layout, b, ctx, w.prefill_chunk), rate, tpot)
        return best

    # ----------------------------------------------------------------- plans
    def _transfer_s(self, chips: int) -> float:
        """P -> D cache hand-off: over the scale-up fabric inside one domain, else the NIC."""
        if chips <= self.hw.scaleup_domain:
            bw = self.hw.need("scaleup_gbps", "the P -> D transfer") * GB * self.hw.efficiency.scaleup_eff
            return self.costs.seq_cache_bytes(self.w.context) / bw
        return kv_transfer_s(self.costs, self.hw, self.w.context)

    def _mixed_ttft(self, pool: PoolEstimate) -> float:
        chunk = min(self.w.prefill_chunk, self.w.context)
        step = prefill_step(self.costs, self.hw, pool.layout, chunk, self.w.context)
        return (math.ceil(self.w.context / chunk) + pool.layout.pp - 1) * step.total_s + pool.latency_s

    def require_numbers(self, chips: int) -> None:
        hw, scheme = self.hw, self.costs.scheme
        needs = {"hbm_tbps": "the memory roofline", "scaleup_gbps": "TP/EP traffic inside the domain",
                 hw.compute_field(COMPUTE_PATHS[scheme.routed_compute]): "expert matmuls",
                 hw.compute_field(COMPUTE_PATHS[scheme.dense_compute]): "dense matmuls",
                 "bf16_tflops": "attention matmuls"}
        if chips > hw.scaleup_domain:
            needs["scaleout_gbps"] = "traffic across scale-up domains"
        hw.require(needs)

    def plans(self, chips: int) -> list[Plan]:
        self.require_fit(chips)
        self.require_numbers(chips)
        w, out = self.w, []
        mixed = self.mixed_pool(chips)
        if mixed is not None:
            rps = mixed.tokens_per_s / w.output
            out.append(Plan("colocated", chips, None, mixed, rps, self._mixed_ttft(mixed), mixed.latency_s, w))
        out += self._splits(chips).values()
        return sorted(out, key=_rank, reverse=True)

    def _split(self, chips: int, p_chips: int) -> Plan | None:
        w = self.w
        pre, dec = self.prefill_pool(p_chips), self.decode_pool(chips - p_chips)
        if pre is None or dec is None:
            return None
        rps = min(pre.tokens_per_s / max(1, w.context), dec.tokens_per_s / w.output)
        return Plan("disaggregated", chips, pre, dec, rps, pre.latency_s + self._transfer_s(chips), dec.latency_s, w)

    def _splits(self, chips: int) -> dict[int, Plan]:
        """Disaggregated plans by prefill chips: every multiple of the split unit when there are at
        most SPLIT_POINTS of them, else a grid of about SPLIT_POINTS refined around its best point
        until the step is one unit (a few hundred splits however large the pool)."""
        unit = self.hw.split_unit
        last = (chips - 1) // unit  # prefill gets k units, k = 1 .. last
        found: dict[int, Plan] = {}
        lo, hi = 1, last
        while lo <= hi:
            stride = max(1, -(-(hi - lo) // SPLIT_POINTS))
            for k in sorted(set(range(lo, hi + 1, stride)) | {hi}):
                if k * unit not in found:
                    plan = self._split(chips, k * unit)
                    if plan is not None:
                        found[k * unit] = plan
            if stride == 1:
                break
            near = [(c, p) for c, p in found.items() if lo * unit <= c <= hi * unit]
            if not near:
                break
            best = max(near, key=lambda item: _rank(item[1]))[0] // unit
            lo, hi = max(1, best - stride + 1), min(last, best + stride - 1)
        return found

    def fits(self, chips: int) -> bool:
        """Some decode layout of `chips` chips holds the weights and at least one sequence."""
        return any(self.max_batch(lay, self.w.decode_context) >= 1
                   for lay in layout_candidates(self.costs.cfg, self.hw, chips, "decode"))

    def min_fitting_chips(self, start: int, step: int = 1) -> int | None:
        """The first chip count >= start, in multiples of `step`, that `fits` accepts (layouts,
        not total bytes: TP must divide the heads, each TP group holds the non-routed weights, ...);
        None when none of the next FIT_SEARCH_COUNTS counts does."""
        first = -(-max(1, start) // step) * step
        for n in range(first, first + FIT_SEARCH_COUNTS * step, step):
            if n <= MAX_CHIPS and self.fits(n):
                return n
        return None

    def require_fit(self, chips: int) -> None:
        """A clear error when not even the weights fit, saying what is short and by how much, and
        the chip count whose layouts do fit."""
        c, hw = self.costs, self.hw
        if self.fits(chips):
            return
        per_chip = self.capacity - self.w.workspace_gb * GB
        usable = chips * per_chip
        one_seq = c.seq_cache_bytes(self.w.decode_context)
        need = c.weights.total + one_seq
        head = (f"{self.model_name} ({c.scheme.name} weights) does not fit on {chips} x {hw.name}: needs "
                f"{need / GB:,.0f} GB (weights {c.weights.total / GB:,.0f} GB + one {self.w.decode_context}-token "
                f"sequence {one_seq / GB:,.2f} GB), usable {usable / GB:,.0f} GB "
                f"({chips} x {self.mem_bytes / GB:.0f} GB x {1 - self.w.headroom:.2f} - workspace)")
        if need > usable:
            head += f"; short by {math.ceil((need - usable) / GB):,} GB"
        else:  # the bytes would fit in total: the layout rules are what fails
            head += ("; the total fits but no layout does (each TP group holds all the non-routed weights, TP "
                     f"divides the attention heads within the {hw.scaleup_domain}-chip scale-up domain, "
                     f"EP at most {c.cfg.num_experts} experts, the chips split evenly into TP x DP x PP)")
        if per_chip <= 0:
            hint = (f"a {hw.name} chip keeps nothing after headroom and the {self.w.workspace_gb:g} GB workspace: "
                    "check its mem_gb")
        else:
            estimate = max(chips + 1, math.ceil(need / per_chip))
            min_chips = self.min_fitting_chips(estimate)
            per_node = hw.chips_per_node if hw.figure("chips_per_node").known else None
            min_nodes = self.min_fitting_chips(min_chips, per_node) if per_node and min_chips else None
            if min_chips is None:
                hint = f"no layout of up to {estimate + FIT_SEARCH_COUNTS - 1:,} chips fits; use smaller --weights"
            else:
                hint = f"the first count whose layouts fit is {min_chips} chips (--chips {min_chips})"
                if min_nodes is not None:
                    hint += f" or --nodes {min_nodes // per_node}"
                hint += "; or smaller --weights"
        raise ConfigError(head, field="nodes", hint=hint)


def _rank(plan: Plan) -> tuple[bool, float]:
    return plan.meets(), plan.output_per_chip


def best_plan(costs: ModelCosts, hw: Hardware, workload: Workload, chips: int,
              model_name: str = "") -> tuple[Plan, list[Plan]]:
    if chips > MAX_CHIPS:
        raise ConfigError(f"{chips:,} chips is more than the planner's limit of {MAX_CHIPS:,}", field="chips",
                          hint=f"plan at most {MAX_CHIPS:,} chips (--chips or --nodes x chips per node)")
    plans = Planner(costs, hw, workload, model_name).plans(chips)
    if not plans and (workload.slo_ttft_s is not None or workload.slo_tpot_s is not None):
        free = Planner(costs, hw, replace(workload, slo_ttft_s=None, slo_tpot_s=None), model_name).plans(chips)
        if free:  # the model fits: the latency target is what no layout reaches
            slo = ", ".join(x for x in (f"TTFT <= {workload.slo_ttft_s:g} s" if workload.slo_ttft_s else "",
                                        f"TPOT <= {workload.slo_tpot_s * 1e3:g} ms" if workload.slo_tpot_s else "")
                            if x)
            raise ConfigError(f"no layout of {chips} x {hw.name} meets the SLO ({slo}) at any batch; the model "
                              "fits, the latency target is out of reach",
                              field="slo-tpot" if workload.slo_tpot_s is not None else "slo-ttft",
                              hint="relax --slo-tpot / --slo-ttft (or --no-slo), or add chips")
    if not plans:
        raise ConfigError(f"no layout of {chips} x {hw.name} fits this model with a useful batch",
                          field="nodes", hint="add nodes, lower --context or use smaller --weights")
    return plans[0], plans
