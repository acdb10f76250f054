"""`/v1/completions` with `echo` and prompt logprobs (what lm-eval's loglikelihood tasks read).

`echo`: the first chunk's text starts with the prompt, and with `logprobs` the logprob lists
start with the prompt's tokens (the first one has no logprob: nothing precedes it), as on
OpenAI's legacy completions. `prompt_logprobs` (vLLM's extension) adds them to the choice as
`prompt_logprobs`: None for the first token, then {token id: {logprob, decoded_token}} with the
prompt's own token and the top n. Both come from the engine's prefill (engine/prompt_logprobs.py).
"""

from __future__ import annotations

import dataclasses

from deltamoe.serve.api.format import CompletionFormatter, prompt_logprobs_entries
from deltamoe.serve.api.schemas import CompletionRequest, CompletionResponse
from deltamoe.serve.engine.outputs import RequestOutput
from deltamoe.serve.engine.sampling import TokenLogprob
from deltamoe.tokenizers.base import Tokenizer


def prompt_logprobs_count(req: CompletionRequest) -> int | None:
    """How many top prompt logprobs the engine must compute (None: none)."""
    echoed = req.logprobs if req.echo else None
    if req.prompt_logprobs is None:
        return echoed
    return max(req.prompt_logprobs, echoed or 0)


class EchoCompletionFormatter(CompletionFormatter):
    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, req: CompletionRequest,
                 prompt: str | list[int] | None = None):
        super().__init__(request_id, model, tokenizer, req.logprobs is not None)
        self.echo, self.prompt_top = req.echo, req.prompt_logprobs
        self.prompt = req.prompt if prompt is None else prompt  # `prompt`: this choice's, in a batch
        self._first = True
        self._prompt_logprobs: list[dict | None] | None = None

    def add(self, out: RequestOutput) -> CompletionResponse | None:
        if not self._first:
            return super().add(out)
        self._first = False
        scored = out.prompt_logprobs or []
        if self.prompt_top is not None:
            self._prompt_logprobs = prompt_logprobs_entries(self.tokenizer, scored)
        echo_logprobs = self.echo and self._logprobs is not None
        if self.echo:
            ids = self.prompt if isinstance(self.prompt, list) else self.tokenizer.encode(self.prompt)
            text = self.prompt if isinstance(self.prompt, str) else self.tokenizer.decode(ids)
            # The first prompt token: a placeholder entry, blanked below (nothing precedes it).
            entries = [TokenLogprob(ids[0], 0.0, []), *scored] if echo_logprobs else []
            out = dataclasses.replace(out, delta_text=text + out.delta_text,
                                      delta_logprobs=entries + (out.delta_logprobs or []))
        chunk = super().add(out)
        if echo_logprobs:
            for lists in (self._logprobs, chunk.choices[0].logprobs):
                lists.token_logprobs[0] = lists.top_logprobs[0] = None
        if chunk is not None and self._prompt_logprobs is not None:
            chunk.choices[0].prompt_logprobs = self._prompt_logprobs
        return chunk

    def response(self) -> CompletionResponse:
        body = super().response()
        body.choices[0].prompt_logprobs = self._prompt_logprobs
        return body
