"""Prometheus metrics for the HTTP server, in a registry of its own per app.

A per-app registry (not prometheus_client's global one) keeps two servers in one process, or
one test after another, from sharing counters. Request-level numbers (HTTP status, TTFT, TPOT,
end-to-end latency) are observed by the server as requests finish; engine-level numbers
(queues, cache usage, prefix hits, preemptions) are read from `AsyncLLMEngine.stats()` at
scrape time, so they can never drift from what the engine reports. A multi-worker replica adds
per-rank step times, tokens per expert (`deltamoe_rank_*`, `deltamoe_expert_tokens`) and the expert
load imbalance now and under an EPLB-style rebalanced placement (`deltamoe_expert_imbalance`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deltamoe.serve.engine.outputs import EngineStats
from deltamoe.serve.executor.base import RankReport
from deltamoe.serve.executor.rebalance import plan_placement

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class RequestTiming:
    """Wall-clock marks of one request, as the client sees them (from arrival at the server)."""

    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    end: float | None = None
    num_output_tokens: int = 0

    def tokens(self, n: int) -> None:
        if n and self.first_token is None:
            self.first_token = time.perf_counter()
        self.num_output_tokens += n

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (tokens - 1): vLLM's definition, undefined for a single token."""
        if self.first_token is None or self.end is None or self.num_output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.num_output_tokens - 1)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def collect(self):
        s = self._stats()
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        families = [
            (gauge, "deltamoe_num_requests_running", "Requests in the running batch.", s.num_running),
            (gauge, "deltamoe_num_requests_waiting", "Requests queued for admission.", s.num_waiting),
            (gauge, "deltamoe_kv_cache_usage_ratio", "Share of KV/indexer blocks held by live sequences.",
             s.block_usage),
            (gauge, "deltamoe_state_slot_usage_ratio", "Share of KDA state slots held by running sequences.",
             s.slot_usage),
            (gauge, "deltamoe_cache_free_blocks", "Free KV/indexer blocks.", s.num_free_blocks),
            (gauge, "deltamoe_prefix_snapshots", "KDA prefix snapshots held.", s.num_snapshots),
            (gauge, "deltamoe_prefix_cache_hit_rate",
             "Prompt tokens served from the prefix cache / prompt tokens admitted.", s.prefix_hit_rate),
            (counter, "deltamoe_num_preemptions", "Sequences preempted to free cache memory.", s.num_preemptions),
            (counter, "deltamoe_prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens_total),
            (counter, "deltamoe_generation_tokens", "Tokens generated.", s.generation_tokens_total),
            (counter, "deltamoe_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
             s.prefix_hit_tokens),
            (counter, "deltamoe_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.",
             s.prefix_query_tokens),
            (counter, "deltamoe_engine_steps", "Engine steps run.", s.steps),
        ]
        for family, name, doc, value in families:
            yield family(name, doc, value=float(value))
        for key, value in s.extra.items():  # whatever the engine adds later shows up without a server change
            family = CounterMetricFamily if key in s.extra_counters else GaugeMetricFamily  # counters get _total
            yield family(f"deltamoe_engine_{key}", f"Engine stat {key}.", value=float(value))


class _RankCollector(Collector):
    """Per rank of a multi-worker replica: step times, and tokens per expert for the experts it holds."""

    def __init__(self, ranks: Callable[[], list[RankReport]]):
        self._ranks = ranks

    def collect(self):
        reports = self._ranks()
        if not reports:
            return
        last = GaugeMetricFamily("deltamoe_rank_step_seconds", "Forward time of the rank's last reported step.",
                                 labels=["rank"])
        total = CounterMetricFamily("deltamoe_rank_forward_seconds", "Forward time of the rank's steps.",
                                    labels=["rank"])
        steps = CounterMetricFamily("deltamoe_rank_steps", "Steps the rank has run.", labels=["rank"])
        experts = CounterMetricFamily("deltamoe_expert_tokens", "Tokens routed to each expert, by the first rank "
                                      "holding it (TP ranks of one expert group count the same tokens) and the "
                                      "MoE layer (its row in layer order).", labels=["rank", "layer", "expert"])
        counted: set[int] = set()  # expert groups already exported: summing the series gives the true total
        for r in sorted(reports, key=lambda r: r.rank):
            rank = str(r.rank)
            last.add_metric([rank], r.last_step_seconds)
            total.add_metric([rank], r.forward_seconds_total)
            steps.add_metric([rank], r.steps)
            if r.first_expert in counted:
                continue
            counted.add(r.first_expert)
            for layer, row in enumerate(r.expert_tokens):
                for i, tokens in enumerate(row):
                    experts.add_metric([rank, str(layer), str(r.first_expert + i)], tokens)
        yield from (last, total, steps, experts)
        slices = {r.first_expert: r.expert_tokens for r in reports}  # TP ranks of one expert group agree
        if len(slices) > 1 and any(any(row) for row in next(iter(slices.values()))):
            ordered = [slices[first] for first in sorted(slices)]
            load = [sum((part[layer] for part in ordered), []) for layer in range(len(ordered[0]))]
            placement = plan_placement(load, len(ordered))
            balance = GaugeMetricFamily("deltamoe_expert_imbalance", "Max / mean tokens per expert-parallel rank, "
                                        "per MoE layer: with today's placement, and with the rebalanced plan "
                                        "(serve/executor/rebalance.py).", labels=["layer", "placement"])
            for layer, (now, planned) in enumerate(zip(placement.imbalance_now, placement.imbalance_planned)):
                balance.add_metric([str(layer), "now"], now)
                balance.add_metric([str(layer), "planned"], planned)
            yield balance


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], ranks: Callable[[], list[RankReport]] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = Counter("deltamoe_http_requests", "HTTP requests by endpoint and status code.",
                                     ["endpoint", "status"], registry=r)
        self.finished = Counter("deltamoe_request_finished", "Generation requests finished, by finish reason.",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("deltamoe_time_to_first_token_seconds", "Time from request arrival to the first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("deltamoe_time_per_output_token_seconds",
                              "(e2e - ttft) / (output tokens - 1), per request.", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("deltamoe_e2e_request_latency_seconds", "Time from request arrival to its last token.",
                             buckets=_E2E_BUCKETS, registry=r)
        r.register(_EngineCollector(stats))
        if ranks is not None:
            r.register(_RankCollector(ranks))

    def observe(self, timing: RequestTiming, finish_reason: str) -> None:
        if timing.end is None:
            timing.end = time.perf_counter()
        self.finished.labels(finish_reason).inc()
        self.e2e.observe(timing.end - timing.start)
        if timing.ttft is not None:
            self.ttft.observe(timing.ttft)
        if timing.tpot is not None:
            self.tpot.observe(timing.tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class HTTPMetricsMiddleware:
    """Counts every HTTP request by route template (not raw path, to bound label cardinality) and status."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # if the app raises before answering, the error middleware outside us sends a 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = scope.get("route")
            self.metrics.http_requests.labels(getattr(route, "path", "unmatched"), str(status)).inc()
