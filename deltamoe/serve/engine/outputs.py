"""What the engine hands back: per-step RequestOutput (streaming), Completion (offline), EngineStats (/metrics)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from deltamoe.serve.engine.sampling import TokenLogprob


@dataclass(slots=True)  # one per running request per step: cheaper to build
class RequestOutput:
    """One request's progress in one step. Deltas are new since the previous output of this request."""

    request_id: str
    delta_text: str  # text safe to show now (UTF-8 complete, never past a stop string)
    delta_token_ids: list[int]
    delta_logprobs: list[TokenLogprob] | None  # None unless the request asked for logprobs
    text: str  # all output text so far
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.., in the first output (when asked)


@dataclass
class Completion:
    """A finished request (offline `generate`)."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    prompt: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. (when asked)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_blocks: int
    num_free_blocks: int
    block_usage: float  # share of blocks referenced by live sequences
    num_state_slots: int
    slot_usage: float  # share of state slots held by running sequences
    num_snapshots: int  # KDA prefix snapshots held
    prefix_hit_rate: float  # prompt tokens served from the cache / prompt tokens admitted
    prefix_hit_tokens: int
    prefix_query_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished: int
    steps: int
    extra: dict[str, float] = field(default_factory=dict)
    extra_counters: frozenset[str] = frozenset()  # the keys of `extra` that are running totals (Prometheus counters)

    def as_dict(self) -> dict[str, float]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("extra", "extra_counters")}
        return {**d, **self.extra}


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput | None:
    """Several consecutive outputs of one request as one (deltas joined, the rest from the last)."""
    if not outputs:
        return None
    last = outputs[-1]
    logprobs = None if last.delta_logprobs is None else [lp for o in outputs for lp in o.delta_logprobs or []]
    return dataclasses.replace(last, delta_text="".join(o.delta_text for o in outputs),
                               delta_token_ids=[t for o in outputs for t in o.delta_token_ids],
                               delta_logprobs=logprobs)
