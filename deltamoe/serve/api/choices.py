"""`n` > 1, `best_of` and several prompts: several choices per prompt, from one prefill each
(engine/forks.py).

Choice i samples with seed `seed + i` when the request has a seed (so choice 0 is what the same
request with n=1 returns), from its own random seed otherwise. The choices run as sequences of
one engine request group: choices 1.. are sent first, naming choice 0 (`fork_of`), so they wait
for its prefill and fork its cache. Streaming sends each choice's chunks as they come, tagged
with the choice's `index`; `best_of` (not streamable, as on vLLM) generates `best_of` choices and
returns the `n` with the highest total logprob. Usage counts the prompt once and every generated
token, of kept and dropped choices alike. On a decode server (`kv_transfer`), choice 0's prompt is
handed off by a prefill server like any request's, and the others fork its cache as it lands.

A completions request with a list of prompts (OpenAI's legacy batch; lm-eval sends them with a
batch size) runs one such group per prompt, all at once: prompt b's choices are indices b * n ..
b * n + n - 1, as on OpenAI and vLLM, and usage adds up every prompt's tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from deltamoe.errors import RequestError
from deltamoe.serve.api.errors import APIError, from_request_error
from deltamoe.serve.api.format import ChatFormatter, usage_of
from deltamoe.serve.api.disconnect import CLIENT_CLOSED, ClientGone, unless_disconnected
from deltamoe.serve.api.generate import Formatter, Generation, _engine_failed
from deltamoe.serve.api.metrics import RequestTiming
from deltamoe.serve.api.params import rename
from deltamoe.serve.api.schemas import SEED_MAX, CompletionTokensDetails, PromptTokensDetails, Usage
from deltamoe.serve.engine.async_engine import EngineDeadError
from deltamoe.serve.engine.outputs import RequestOutput
from deltamoe.serve.engine.sampling import SamplingParams

MAX_CHOICES = 16  # n and best_of: more would let one request take the whole batch
MAX_BATCH_SEQUENCES = 256  # prompts x choices of one request


@dataclasses.dataclass
class Group:
    """One prompt's choices: their formatters and params, and how many to keep (n of best_of)."""
    prompt: str | list[int]
    fmts: list[Formatter]
    params: list[SamplingParams]
    keep: int
    images: list | None = None  # the prompt's images (chat), given to every choice's sequence


def choice_count(n: int | None, best_of: int | None, stream: bool) -> tuple[int, int]:
    """(n, choices to generate), checked; (1, 1) for an ordinary request."""
    n = 1 if n is None else n
    gen = n if best_of is None else best_of
    if not 1 <= n <= MAX_CHOICES:
        raise APIError(400, f"n: expected an integer in [1, {MAX_CHOICES}], got {n}", param="n", code="invalid_value")
    if not n <= gen <= MAX_CHOICES:
        raise APIError(400, f"best_of: expected an integer in [n={n}, {MAX_CHOICES}], got {best_of}",
                       param="best_of", code="invalid_value")
    if gen > n and stream:
        raise APIError(400, "best_of: best_of > n cannot be streamed", param="best_of", code="invalid_value")
    return n, gen


def check_room(num_prompt_tokens: int, max_tokens: int | None, count: int, capacity: int, field: str = "n") -> None:
    """The prompt plus every choice's max_tokens must fit the cache at once (the prompt is shared).
    `field`: the request field that asked for `count` choices (n, or best_of when it is the larger)."""
    if max_tokens is not None and count > 1 and num_prompt_tokens + count * max_tokens > capacity:
        raise APIError(400, f"{field}: prompt ({num_prompt_tokens} tokens) + {count} choices x max_tokens "
                       f"({max_tokens}) exceeds the cache's {capacity} tokens", param=field, code="invalid_value")


def choice_seed(seed: int, i: int) -> int:
    """Choice i's seed: seed + i, wrapped past the largest seed a request may send (2**64 - 1, what
    torch's generator takes) to 0, 1, ... (was a 500: "Overflow when unpacking long long")."""
    return seed + i if seed + i <= SEED_MAX else seed + i - 2**64


def choice_params(params: SamplingParams, count: int, ranked: bool) -> list[SamplingParams]:
    """Per-choice params: `choice_seed`; with `ranked` (best_of), the sampled tokens' logprobs are kept."""
    out = []
    for i in range(count):
        p = dataclasses.replace(params, seed=None if params.seed is None else choice_seed(params.seed, i))
        if ranked and p.logprobs is None:
            p.logprobs = 0
        out.append(p)
    return out


class Choices:
    """Runs the choices of one request (one group per prompt) and answers it (streaming or one body).
    Choice k of the flat list is group b's choice j, k = b's first + j."""

    def __init__(self, gen: Generation, groups: list[Group]):
        self.gen, self.groups = gen, groups
        self.fmts = [f for g in groups for f in g.fmts]
        self.starts = [0, *itertools.accumulate(len(g.fmts) for g in groups)][:-1]
        self.scores = [0.0] * len(self.fmts)

    async def respond(self, request: Request, stream: bool, include_usage: bool,
                      kv_transfer: object | None = None) -> Response:
        engine, rid = self.gen.engine, self.fmts[0].id
        streams = []
        for g, start in zip(self.groups, self.starts):
            # Every choice holds the images: a child that cannot fork its parent's cache prefills itself.
            streams += [engine.generate(g.prompt, p, request_id=f"{rid}-{start + j}",
                                        fork_of=f"{rid}-{start}" if j else None,
                                        kv_transfer=kv_transfer if start + j == 0 else None, images=g.images)
                        for j, p in enumerate(g.params)]
        # Each group's forks first: the engine must hold them when their parent arrives (engine/forks.py).
        parents = set(self.starts)
        order = [k for k in range(len(streams)) if k not in parents] + self.starts
        started = {k: asyncio.ensure_future(streams[k].__anext__()) for k in order}
        firsts = [started[k] for k in range(len(streams))]
        timing = RequestTiming()
        try:
            first = await unless_disconnected(request, asyncio.gather(*firsts))
        except RequestError as e:
            await self._close(streams, firsts)
            raise from_request_error(rename(e, self.gen.field_names)) from e
        except EngineDeadError as e:
            await self._close(streams, firsts)
            raise _engine_failed(e) from e
        except ClientGone:
            await self._close(streams, firsts)
            self.gen.metrics.observe(timing, "abort")
            return Response(status_code=CLIENT_CLOSED)
        merged = self._merge(first, streams, timing)
        if stream:  # best_of > n is refused for streams: choice k is output index k
            events = self._events(merged, timing, include_usage, lambda: self._close(streams, firsts))
            return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(events.aclose),
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        reason = "abort"  # the client left (or the request was cut short): not choice 0's reason
        try:
            await unless_disconnected(request, self._drain(merged))
            reason = self.fmts[0].last.finish_reason or "abort"
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        except EngineDeadError as e:
            reason = "error"
            raise _engine_failed(e) from e
        finally:
            timing.end = time.perf_counter()
            self.gen.metrics.observe(timing, reason)
            await self._close(streams, firsts)
        return JSONResponse(self._response().model_dump())

    async def _merge(self, first: list[RequestOutput], streams: list, timing: RequestTiming) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as each arrives, until every choice has finished."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            out = first[i]
            try:
                await queue.put((i, out))
                while not out.finished:
                    out = await streams[i].__anext__()
                    await queue.put((i, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
                await queue.put((i, e))

        pumps = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
        try:
            left = len(streams)
            while left:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                timing.tokens(len(item.delta_token_ids))
                if item.delta_logprobs:
                    self.scores[i] += sum(lp.logprob for lp in item.delta_logprobs)
                left -= item.finished
                yield i, item
        finally:
            for p in pumps:
                p.cancel()

    async def _drain(self, merged: AsyncIterator[tuple[int, RequestOutput]]) -> None:
        async for i, out in merged:
            self.fmts[i].add(out)

    async def _events(self, merged, timing: RequestTiming, include_usage: bool,
                      close: Callable) -> AsyncIterator[str]:
        reason = "abort"
        try:
            async for i, out in merged:
                chunk = self.fmts[i].add(out)
                if chunk is not None:
                    chunk.choices[0].index = i
                    if self.gen.continuous_usage:  # stream_options.continuous_usage_stats: all choices so far
                        chunk.usage = self._usage()
                    yield f"data: {chunk.model_dump_json()}\n\n"
            reason = self.fmts[0].last.finish_reason or "abort"
            if include_usage:
                chunk = self.fmts[0].usage_chunk()
                chunk.usage = self._usage()
                yield f"data: {chunk.model_dump_json()}\n\n"
        except EngineDeadError as e:
            reason = "error"
            yield f"data: {json.dumps(_engine_failed(e).body())}\n\n"
        finally:
            timing.end = time.perf_counter()
            self.gen.metrics.observe(timing, reason)
            await close()
        yield "data: [DONE]\n\n"

    def _usage(self) -> Usage:
        """Every choice's tokens so far (mid-stream, a choice yet to arrive counts none), and each
        prompt once (its first choice to arrive says its length)."""
        last = [f.last for f in self.fmts if f.last is not None]
        completion = sum(o.num_output_tokens for o in last)
        heads = [next(f.last for f in g.fmts if f.last is not None) for g in self.groups
                 if any(f.last is not None for f in g.fmts)]
        prompt = sum(usage_of(o).prompt_tokens for o in heads)
        usage = Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                      prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in heads)))
        # Chat choices that reason count their reasoning tokens, summed as their completion tokens are.
        details = [u.completion_tokens_details for f in self.fmts if isinstance(f, ChatFormatter)
                   and (u := f.usage()).completion_tokens_details is not None]
        if details:
            usage.completion_tokens_details = CompletionTokensDetails(
                reasoning_tokens=sum(d.reasoning_tokens for d in details))
        return usage

    def _response(self) -> BaseModel:
        body = self.fmts[0].response()
        body.choices = []
        for g, start in zip(self.groups, self.starts):  # each prompt's kept choices, best first under best_of
            members = range(start, start + len(g.fmts))
            order = sorted(members, key=lambda i: -self.scores[i])[: g.keep] if g.keep < len(g.fmts) else members
            for i in order:
                choice = self.fmts[i].response().choices[0]
                choice.index = len(body.choices)
                body.choices.append(choice)
        body.usage = self._usage()
        return body

    @staticmethod
    async def _close(streams: list, firsts: list) -> None:
        for f in firsts:
            if not f.done():
                f.cancel()
        for s in streams:
            try:
                await s.aclose()
            except Exception:  # noqa: BLE001 - closing only aborts the engine request
                pass


def wants_choices(req, prompts: int = 1) -> bool:
    """Anything but the default single choice of one prompt (bad values included: `choice_count`
    refuses them)."""
    return req.n not in (None, 1) or getattr(req, "best_of", None) not in (None, 1) or prompts > 1


async def respond_choices(gen: Generation, request: Request, req, prompts: list[str | list[int]],
                          params: SamplingParams, make_formatter: Callable[[int], Formatter], include_usage: bool,
                          kv_transfer: object | None = None, images: list | None = None) -> Response:
    """The server's path for a request with n > 1, best_of > 1 or several prompts (see the module
    docstring); `make_formatter(b)`: a formatter for one of prompt b's choices; `images`: a chat
    request's images (one prompt)."""
    stream = bool(req.stream)
    n, count = choice_count(req.n, getattr(req, "best_of", None), stream)
    if len(prompts) * count > MAX_BATCH_SEQUENCES:
        raise APIError(400, f"prompt: {len(prompts)} prompts x {count} choices exceeds {MAX_BATCH_SEQUENCES} "
                       "sequences per request", param="prompt", code="invalid_value")
    if len(prompts) > 1 and kv_transfer is not None:
        raise APIError(400, "prompt: several prompts on a decode server (prefill/decode disaggregation): not yet "
                       "(send one request per prompt)", param="prompt", code="unsupported_value")
    engine = gen.engine.engine
    groups = []
    for b, prompt in enumerate(prompts):
        num_prompt = len(prompt) if isinstance(prompt, list) else len(engine.tokenizer.encode(prompt))
        check_room(num_prompt, params.max_tokens, count, engine.cache.max_tokens_per_sequence(),
                   "best_of" if count > n else "n")
        groups.append(Group(prompt, [make_formatter(b) for _ in range(count)], choice_params(params, count, count > n),
                            n, images))
    return await Choices(gen, groups).respond(request, stream, include_usage, kv_transfer)
