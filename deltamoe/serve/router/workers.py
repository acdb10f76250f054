"""The router's workers: checked once at start-up, then picked by load for every request.

At start-up every worker must answer `GET /internal/kv_transfer/info` with the role it was
given on the router's command line, the same served model name, weights fingerprint and cache
signature (model config, weights, cache layout, dtype, block size) as every other: a pairing that
cannot hand off, or whose decode side would continue another model's cache, is refused with one
line before the router opens its port. While serving, a worker is picked by the router's own count
of requests in flight on it (its queue as the router sees it), then by the free cache blocks
it last reported; a worker that failed a request sits out for `cooldown_s`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx

from deltamoe.errors import ConfigError

INFO_PATH = "/internal/kv_transfer/info"


@dataclass
class Worker:
    url: str
    role: str
    in_flight: int = 0
    free_blocks: int = 0
    failures: int = 0
    down_until: float = 0.0
    info: dict = field(default_factory=dict)

    @property
    def available(self) -> bool:
        return time.monotonic() >= self.down_until


class WorkerPool:
    def __init__(self, prefill: list[str], decode: list[str], cooldown_s: float = 5.0):
        if not prefill or not decode:
            raise ConfigError("a router needs at least one prefill and one decode server",
                              field="prefill" if not prefill else "decode", hint="--prefill URL --decode URL")
        self.workers = [Worker(u.rstrip("/"), "prefill") for u in prefill] + [Worker(u.rstrip("/"), "decode")
                                                                          for u in decode]
        self.cooldown_s = cooldown_s

    def check(self, headers: dict[str, str], timeout_s: float = 5.0) -> None:
        """Start-up check: reachable, the right role, one model name, weights and signature; a ConfigError naming the worker otherwise."""
        for w in self.workers:
            try:
                r = httpx.get(w.url + INFO_PATH, headers=headers, timeout=timeout_s)
            except httpx.HTTPError as e:
                raise ConfigError(f"{w.url} does not answer {INFO_PATH} ({type(e).__name__}: {e})",
                                  field=w.role, hint="start it with `deltamoe serve ... --role "
                                  f"{w.role} --kv-transfer mooncake` and check the URL") from e
            if r.status_code == 401:
                raise ConfigError(f"{w.url} refuses the router's API key ({'a different key' if headers else 'none sent'})",
                                  field="api_key", hint="the workers' key in --api-key or DELTAMOE_API_KEY")
            try:
                r.raise_for_status()
                w.info = r.json()
            except (httpx.HTTPError, ValueError) as e:
                raise ConfigError(f"{w.url} does not answer {INFO_PATH} (HTTP {r.status_code})", field=w.role,
                                  hint=f"is it a deltamoe server started with --role {w.role} --kv-transfer mooncake?") from e
            if w.info.get("role") != w.role:
                raise ConfigError(f"{w.url} runs as {w.info.get('role')!r}, not {w.role!r}", field=w.role,
                                  hint=f"start it with --role {w.role}")
        first = self.workers[0]
        for w in self.workers[1:]:
            if w.info.get("model") != first.info.get("model"):
                raise ConfigError(f"{w.url} serves model {w.info.get('model')!r}, {first.url} {first.info.get('model')!r}",
                                  field="model", hint="the same checkpoint and --served-model-name on every server")
            if w.info.get("weights") != first.info.get("weights"):
                raise ConfigError(f"{w.url} and {first.url} load different weights (fingerprint {w.info.get('weights')} "
                                  f"!= {first.info.get('weights')})", field="model",
                                  hint="the same checkpoint and --dtype on every server")
            if w.info["block_size"] != first.info["block_size"]:
                raise ConfigError(f"{w.url} uses block size {w.info['block_size']}, {first.url} "
                                  f"{first.info['block_size']}", field="block_size", hint="the same --block-size on all")
            if w.info["signature"] != first.info["signature"]:
                raise ConfigError(f"{w.url} and {first.url} run different models or cache layouts (signature "
                                  f"{w.info['signature']} != {first.info['signature']})", field="model",
                                  hint="the same checkpoint, --dtype and --block-size on every server")
        for w in self.workers:
            w.free_blocks = int(w.info.get("load", {}).get("free_blocks", 0))

    @property
    def model(self) -> str:
        return self.workers[0].info.get("model", "")

    def pick(self, role: str, exclude: set[str]) -> Worker | None:
        """The least loaded available worker of `role` not in `exclude` (else any of the role not excluded)."""
        candidates = [w for w in self.workers if w.role == role and w.url not in exclude]
        ready = [w for w in candidates if w.available] or candidates
        return min(ready, key=lambda w: (w.in_flight, -w.free_blocks), default=None)

    def failed(self, worker: Worker) -> None:
        worker.failures += 1
        worker.down_until = time.monotonic() + self.cooldown_s

    async def refresh(self, client: httpx.AsyncClient) -> None:
        """Read every worker's load (free blocks); an unreachable or unhealthy one (its engine stopped,
        e.g. a worker rank died) sits out."""
        for w in self.workers:
            try:
                r = await client.get(w.url + INFO_PATH, timeout=2.0)
                r.raise_for_status()
                info = r.json()
                w.free_blocks = int(info["load"]["free_blocks"])
                if info.get("healthy") is False:
                    raise RuntimeError("unhealthy")
            except Exception:
                w.down_until = time.monotonic() + self.cooldown_s

    def serving_roles(self) -> dict[str, bool]:
        """{role: whether some worker of it is available now}."""
        return {role: any(w.available for w in self.workers if w.role == role) for role in ("prefill", "decode")}
