"""SamplingParams: what one request asks of the sampler, validated per request (torch-free, so the
command line checks it before anything heavy loads; the sampler itself is `sampling.py`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deltamoe.errors import RequestError

if TYPE_CHECKING:
    from deltamoe.serve.structured.constraint import Constraint

MAX_TOP_LOGPROBS = 20  # the OpenAI API limit
MAX_LOGIT_BIAS = 300  # entries per request, as vLLM allows


# Below this a temperature is greedy, as in vLLM: dividing logits by, say, 1e-300 overflows to inf
# and the sampler's probabilities to NaN, while the limit T -> 0 of sampling is the argmax anyway.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the model's context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; 0: the sampled token's logprob; n: plus the top n
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI)
    structured: Constraint | None = None  # a grammar the output must match (serve/structured/)
    prompt_logprobs: int | None = None  # None: off; 0: each prompt token's logprob; n: plus the top n

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: int) -> None:
        """Raise RequestError naming the first bad field."""
        def need(ok: bool, name: str, expected: str) -> None:
            if not ok:
                raise RequestError(f"expected {expected}, got {getattr(self, name)!r}", field=name)

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        need(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
             "None or an integer >= 1")
        need(is_num(self.temperature) and 0 <= self.temperature <= 100, "temperature", "a number in [0, 100]")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]")
        need(is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0 (0 = off)")
        need(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]")
        need(self.seed is None or is_int(self.seed), "seed", "None or an integer")
        need(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop",
             "a list of non-empty strings")
        need(len(self.stop) <= 16, "stop", "at most 16 stop strings")
        need(isinstance(self.stop_token_ids, list)
             and all(is_int(t) and 0 <= t < vocab_size for t in self.stop_token_ids),
             "stop_token_ids", f"token ids in [0, {vocab_size})")
        need(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
             "logprobs", f"None or an integer in [0, {MAX_TOP_LOGPROBS}]")
        need(self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS),
             "prompt_logprobs", f"None or an integer in [0, {MAX_TOP_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            need(is_num(getattr(self, name)) and -2 <= getattr(self, name) <= 2, name, "a number in [-2, 2]")
        need(self.logit_bias is None or (isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS
                                         and all(is_int(t) and 0 <= t < vocab_size and is_num(b) and -100 <= b <= 100
                                                 for t, b in self.logit_bias.items())),
             "logit_bias", f"at most {MAX_LOGIT_BIAS} token ids in [0, {vocab_size}) with biases in [-100, 100]")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first; empty unless logprobs > 0
