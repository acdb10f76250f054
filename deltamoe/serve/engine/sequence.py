"""Sequence: one request's state inside the engine (tokens, progress, cache handles, sampling state)."""

from __future__ import annotations

import enum
import itertools
import operator
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deltamoe.serve.engine.detokenizer import IncrementalDetokenizer
from deltamoe.serve.engine.image_inputs import SequenceImages
from deltamoe.serve.engine.sampling import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from deltamoe.serve.structured.matcher import GrammarMatcher

_arrivals = itertools.count()
# `Sequence.sort_key` as one C-level getter (the scheduler sorts its running list by it every step).
urgency = operator.attrgetter("priority", "arrival")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    max_tokens: int  # params.max_tokens resolved against the context length
    stop_ids: frozenset[int]  # stop_token_ids, plus EOS unless ignore_eos
    priority: int = 0  # lower is more urgent (vLLM's convention)
    prompt: str | None = None
    status: Status = Status.WAITING
    arrival: int = field(default_factory=lambda: next(_arrivals))
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    # Cache handles (memory is HybridCache's; these are just ids into it).
    num_computed: int = 0  # tokens whose KV/state the cache holds
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks, memoised
    num_published_blocks: int = 0  # leading blocks already offered to the prefix cache
    slot: int | None = None  # KDA state slot
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1.. (prompt_logprobs.py)
    kv_transfer: object | None = None  # a KV connector's hand-off parameters for this request (kv_transfer/)
    grammar: GrammarMatcher | None = None  # params.structured's matcher, advanced with each token
    fork_of: str | None = None  # another choice of the same request, whose prefill this one shares (forks.py)
    forks: list[Sequence] = field(default_factory=list)  # choices waiting to fork this one's prefill
    images: SequenceImages | None = None  # the prompt's images (image_inputs.py)
    # Trailing entries of token_ids that are placeholders (-1) for tokens a step in flight has yet to
    # sample (one-step-ahead scheduling, `executor/overlap.py`); 0 otherwise.
    num_pending: int = 0

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.num_pending]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens - self.num_pending

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: most urgent priority first, then first come (preemption picks the last)."""
        return urgency(self)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
