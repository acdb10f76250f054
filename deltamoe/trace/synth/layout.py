"""Rank layout of a synthetic job: PP outermost, then DP, then TP; EP groups inside DP."""

from __future__ import annotations

from dataclasses import dataclass, field

from deltamoe.errors import ConfigError


@dataclass(frozen=True)
class SynthConfig:
    ranks: int
    steps: int = 4
    pp: int = 1
    microbatches: int = 0          # 0: 2*pp (pipelines) or 2 (no pipeline)
    tp: int = 1
    ep: int = 0                    # 0: largest divisor of dp up to 8
    layers: int = 2                # transformer layers per stage
    stragglers: tuple[int, ...] = ()
    slowdown: float = 1.5
    hot_ranks: tuple[tuple[int, float], ...] = ()  # (rank, token share factor) for MoE imbalance
    jitter: float = 0.02           # relative std of kernel durations
    seed: int = 0
    nccl_names: str = "dev"        # 'dev' -> ncclDevKernel_*, 'legacy' -> ncclKernel_*
    compact: bool = False
    gz: bool = False
    with_seq: bool = False         # newer PyTorch builds record `Seq` on collectives
    p2p: str = "batched"           # 'batched': coalesced kernels (batch_isend_irecv); 'single': isend/irecv
    events_per_rank: int = 0       # 0: no target; otherwise pick layers to get close

    @property
    def m(self) -> int:
        return self.microbatches or (2 * self.pp if self.pp > 1 else 2)

    @property
    def dp(self) -> int:
        return self.ranks // (self.pp * self.tp)

    @property
    def ep_size(self) -> int:
        if self.ep:
            return self.ep
        # The largest divisor of dp up to 8 (one node), so any dp works by default.
        return max(e for e in range(1, min(self.dp, 8) + 1) if self.dp % e == 0)

    def validate(self) -> None:
        if self.ranks < 1:
            raise ConfigError(f"expected >= 1, got {self.ranks}", field="--ranks")
        if self.steps < 1:
            raise ConfigError(f"expected >= 1, got {self.steps}", field="--steps")
        if not self.slowdown > 0:  # a factor on kernel durations: <= 0 would write negative ones
            raise ConfigError(f"expected a factor > 0, got {self.slowdown}", field="--slowdown")
        if self.jitter < 0:
            raise ConfigError(f"expected >= 0, got {self.jitter}", field="--jitter")
        if self.ranks % (self.pp * self.tp):
            raise ConfigError(f"ranks={self.ranks} is not divisible by pp*tp={self.pp * self.tp}",
                              field="--pp")
        if self.dp % self.ep_size:
            raise ConfigError(f"dp={self.dp} is not divisible by ep={self.ep_size}", field="--ep")
        if self.pp > 1 and self.m < self.pp:
            raise ConfigError(f"microbatches={self.m} must be >= pp={self.pp} for 1F1B",
                              field="--microbatches")
        if self.p2p not in ("batched", "single"):
            raise ConfigError(f"unknown P2P style {self.p2p!r}; expected batched or single", field="--p2p")
        bad = [r for r in self.stragglers if not 0 <= r < self.ranks]
        if bad:
            raise ConfigError(f"straggler rank {bad[0]} outside 0..{self.ranks - 1}", field="--straggler")


@dataclass
class Layout:
    cfg: SynthConfig
    groups: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)  # (name, desc, ranks)
    member: dict[int, dict[str, int]] = field(default_factory=dict)  # rank -> desc -> group index

    def coords(self, rank: int) -> tuple[int, int, int]:
        c = self.cfg
        t = rank % c.tp
        d = (rank // c.tp) % c.dp
        s = rank // (c.tp * c.dp)
        return s, d, t

    def rank_of(self, s: int, d: int, t: int) -> int:
        c = self.cfg
        return (s * c.dp + d) * c.tp + t

    def group(self, rank: int, desc: str) -> int:
        return self.member[rank][desc]


def build_layout(cfg: SynthConfig) -> Layout:
    cfg.validate()
    lay = Layout(cfg)
    lay.member = {r: {} for r in range(cfg.ranks)}

    def add(desc: str, ranks: list[int]) -> None:
        gi = len(lay.groups)
        lay.groups.append((str(gi), desc, tuple(ranks)))
        for r in ranks:
            lay.member[r][desc] = gi

    add("default_pg", list(range(cfg.ranks)))
    for s in range(cfg.pp):
        for d in range(cfg.dp):
            if cfg.tp > 1:
                add("tp", [lay.rank_of(s, d, t) for t in range(cfg.tp)])
    for s in range(cfg.pp):
        for t in range(cfg.tp):
            add("dp", [lay.rank_of(s, d, t) for d in range(cfg.dp)])
            for e0 in range(0, cfg.dp, cfg.ep_size):
                if cfg.ep_size > 1:
                    add("ep", [lay.rank_of(s, d, t) for d in range(e0, e0 + cfg.ep_size)])
    if cfg.pp > 1:
        for d in range(cfg.dp):
            for t in range(cfg.tp):
                add("pp", [lay.rank_of(s, d, t) for s in range(cfg.pp)])
    return lay
