"""The router's workers: checked once at start-up, then picked by load for every request.

At start-up every worker must answer `GET /internal/kv_transfer/info` with the role it was
given on the router's command line, the same served model name, weights fingerprint and cache
signature (model config, weights, cache layout, dtype, block size) as every other: a pairing that
cannot hand off, or whose decode side would continue another model's cache, is refused with one
line before the router opens its port. A prefill server must also take prompts as long as every
decode server does (its `max_model_len` at least theirs): the decode server accepts the request,
the prefill server computes its prompt.

While serving, every worker's info is polled (`refresh`, with the router's API key): its load, its
health, and whether it still matches what was checked at start-up (a worker restarted with other
weights or another block size stops being picked until it matches again). A worker is picked by
the router's own count of requests in flight on it (its queue as the router sees it), then by the
free cache blocks it last reported; a worker that failed a request sits out for `cooldown_s`, and
one whose last poll failed is not picked even when nothing else is left (a request would wait on
it for nothing). A worker that has failed `UNRESPONSIVE_POLLS` polls in a row is given up on by the
requests waiting for its answer (`proxy.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx

from deltamoe.errors import ConfigError

INFO_PATH = "/internal/kv_transfer/info"
UNRESPONSIVE_POLLS = 3  # polls failed in a row (~3 x 2 s): requests waiting on the worker give up on it
PAIRED_FIELDS = ("model", "weights", "block_size", "signature")  # equal on every worker, or no hand-off


@dataclass
class Worker:
    url: str
    role: str
    in_flight: int = 0
    free_blocks: int = 0
    failures: int = 0
    down_until: float = 0.0
    info: dict = field(default_factory=dict)
    poll_failures: int = 0  # polls failed in a row (unreachable, an error, or its engine stopped)
    mismatch: str = ""  # why it cannot pair with the others now (it changed since start-up), else ""

    @property
    def available(self) -> bool:
        return not self.mismatch and time.monotonic() >= self.down_until

    @property
    def unresponsive(self) -> bool:
        """Its polls have failed long enough that a request waiting for its answer should give up."""
        return self.poll_failures >= UNRESPONSIVE_POLLS


class WorkerPool:
    def __init__(self, prefill: list[str], decode: list[str], cooldown_s: float = 5.0):
        if not prefill or not decode:
            raise ConfigError("a router needs at least one prefill and one decode server",
                              field="prefill" if not prefill else "decode", hint="--prefill URL --decode URL")
        self.workers = [Worker(u.rstrip("/"), "prefill") for u in prefill] + [Worker(u.rstrip("/"), "decode")
                                                                          for u in decode]
        self.cooldown_s = cooldown_s
        self.headers: dict[str, str] = {}  # the API key, sent with every poll too
        self.reference: dict = {}  # PAIRED_FIELDS as every worker had them at start-up

    def check(self, headers: dict[str, str], timeout_s: float = 5.0) -> None:
        """Start-up check: reachable, the right role, one model name, weights and signature, prefill
        servers that take the decode servers' longest prompts; a ConfigError naming the worker otherwise."""
        self.headers = dict(headers)
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
        longest = max((w.info.get("max_model_len") or 0) for w in self.workers if w.role == "decode")
        for w in self.workers:
            if w.role == "prefill" and (w.info.get("max_model_len") or longest) < longest:
                raise ConfigError(f"{w.url} takes prompts up to {w.info['max_model_len']} tokens, a decode server "
                                  f"up to {longest}: longer ones would be accepted and fail at the hand-off",
                                  field="max_model_len", hint="a --max-model-len on the prefill servers at least "
                                  "the decode servers'")
            w.free_blocks = int(w.info.get("load", {}).get("free_blocks", 0))
        self.reference = {k: first.info.get(k) for k in PAIRED_FIELDS}

    @property
    def max_model_len(self) -> int | None:
        """The longest request every decode server takes (what the router's /v1/models reports)."""
        lengths = [w.info["max_model_len"] for w in self.workers if w.role == "decode" and w.info.get("max_model_len")]
        return min(lengths, default=None)

    @property
    def model(self) -> str:
        return self.workers[0].info.get("model", "")

    def pick(self, role: str, exclude: set[str]) -> Worker | None:
        """The least loaded available worker of `role` not in `exclude`; else (every one sits out after a
        failed request) one that still answers its polls and matches the others."""
        candidates = [w for w in self.workers if w.role == role and w.url not in exclude]
        ready = ([w for w in candidates if w.available]
                 or [w for w in candidates if w.poll_failures == 0 and not w.mismatch])
        return min(ready, key=lambda w: (w.in_flight, -w.free_blocks), default=None)

    def failed(self, worker: Worker) -> None:
        worker.failures += 1
        worker.down_until = time.monotonic() + self.cooldown_s

    async def refresh(self, client: httpx.AsyncClient, workers: list[Worker] | None = None) -> None:
        """Poll `workers` (all by default): load (free blocks), health and pairing. An unreachable or
        unhealthy one (its engine stopped, e.g. a worker rank died) sits out; one that no longer matches
        the start-up check (restarted with other weights, block size, ...) is not picked until it does."""
        for w in self.workers if workers is None else workers:
            try:
                r = await client.get(w.url + INFO_PATH, headers=self.headers, timeout=2.0)
                r.raise_for_status()
                info = r.json()
                w.free_blocks = int(info["load"]["free_blocks"])
                if info.get("healthy") is False:
                    raise RuntimeError("unhealthy")
            except Exception:
                w.poll_failures += 1
                w.down_until = time.monotonic() + self.cooldown_s
                continue
            w.poll_failures = 0
            changed = [k for k in PAIRED_FIELDS if self.reference and info.get(k) != self.reference[k]]
            w.mismatch = (f"its {', '.join(changed)} changed since the router started (restarted with another "
                          "checkpoint, --dtype or --block-size?)" if changed else "")

    def serving_roles(self) -> dict[str, bool]:
        """{role: whether some worker of it is available now}."""
        return {role: any(w.available for w in self.workers if w.role == role) for role in ("prefill", "decode")}

    def describe(self, w: Worker) -> dict:
        return {"url": w.url, "role": w.role, "in_flight": w.in_flight, "available": w.available,
                "failures": w.failures, **({"mismatch": w.mismatch} if w.mismatch else {})}
