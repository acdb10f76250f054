"""The router's Prometheus metrics: outcomes, retries, worker failures, and latency as clients see it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from deltamoe.serve.api.metrics import _E2E_BUCKETS, _LATENCY_BUCKETS


class RouterMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("deltamoe_router_requests", "Client requests by outcome (ok; failed: no pair completed it; cancelled: the client "
                                "left first; rejected: the client's fault, a 4xx or an in-band invalid_request_error).", ["outcome"],
                                registry=r)
        self.retries = Counter("deltamoe_router_retries", "Requests tried again on another prefill/decode pair.",
                               registry=r)
        self.worker_failures = Counter("deltamoe_router_worker_failures",
                                       "Attempts failed by a worker (unreachable, 5xx, broken stream), by role.",
                                       ["role"], registry=r)
        self.ttft = Histogram("deltamoe_router_time_to_first_token_seconds",
                              "Time from a request's arrival at the router to its first streamed event.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("deltamoe_router_time_per_output_token_seconds",
                              "(e2e - ttft) / (events - 1) of a streamed request.", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.e2e = Histogram("deltamoe_router_e2e_request_latency_seconds", "Time from arrival to the last byte.",
                             buckets=_E2E_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
