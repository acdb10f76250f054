"""Parallel layouts of one serving pool and the candidates worth estimating.

An instance is one model replica: TP ranks share each attention layer (heads split), DP
attention ranks hold different sequences, and the routed experts of a pipeline stage are
sharded over all TP x DP ranks of that stage (EP = TP x DP, the SGLang/vLLM wide-EP shape).
Instances are replicated to fill the pool.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from deltamoe.config import ModelConfig
from deltamoe.plan.accelerator import Hardware

PP_CHOICES = (1, 2, 4, 8)
TP_MAX = 16  # beyond this, per-rank attention GEMMs get too thin to be worth estimating


@dataclass(frozen=True)
class PoolLayout:
    role: str  # "prefill" | "decode" | "mixed"
    tp: int
    dp: int  # attention data-parallel ranks per instance
    pp: int
    replicas: int
    redundant_experts: int = 0

    @property
    def ep(self) -> int:
        return self.tp * self.dp

    @property
    def instance_chips(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def chips(self) -> int:
        return self.instance_chips * self.replicas

    @property
    def attention_ranks(self) -> int:
        """Ranks that each run their own batch of sequences, over the whole pool."""
        return self.dp * self.replicas

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"DP{self.dp}"]
        if self.pp > 1:
            parts.append(f"PP{self.pp}")
        text = " x ".join(parts) + f" (EP{self.ep})"
        if self.replicas > 1:
            text += f" x {self.replicas} replicas"
        return text

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"ep": self.ep, "chips": self.chips, "describe": self.describe()}


def divisors(n: int) -> list[int]:
    """Divisors of n in increasing order (O(sqrt n): pools can have 10^5 chips)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def tp_choices(cfg: ModelConfig, hw: Hardware) -> list[int]:
    """TP sizes that split every attention kind's heads evenly and stay inside the scale-up domain."""
    domain = hw.scaleup_domain
    heads = [cfg.num_attention_heads]
    if "kda" in cfg.layer_types:
        heads.append(cfg.kda_num_heads)
    return [t for t in divisors(min(TP_MAX, domain)) if all(h % t == 0 for h in heads)]


def pp_choices(cfg: ModelConfig) -> list[int]:
    """Pipeline stages never split an AttnRes block (spec §3), so at most one stage per block."""
    block = cfg.attn_res_block_size or 1
    blocks = -(-cfg.num_hidden_layers // block)
    return [p for p in PP_CHOICES if p <= blocks]


def layout_candidates(cfg: ModelConfig, hw: Hardware, chips: int, role: str,
                      redundant_experts: int = 0) -> list[PoolLayout]:
    out = []
    for pp in pp_choices(cfg):
        for tp in tp_choices(cfg, hw):
            if chips % (tp * pp):
                continue
            for dp in divisors(chips // (tp * pp)):
                ep = tp * dp
                if ep > cfg.num_experts + redundant_experts:
                    continue
                replicas = chips // (tp * dp * pp)
                out.append(PoolLayout(role, tp, dp, pp, replicas, redundant_experts))
    return out
