"""OpenAI request fields -> the engine's SamplingParams, with errors that use the client's field names.

The engine names fields its own way (`logprobs` is a count, `max_tokens` is the only limit);
a chat client sent `top_logprobs` and maybe `max_completion_tokens`, so an error about those
must say so. Features this server does not implement are refused here, never ignored.
"""

from __future__ import annotations

from deltamoe.errors import RequestError
from deltamoe.serve.api.echo import prompt_logprobs_count
from deltamoe.serve.api.errors import APIError
from deltamoe.serve.api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from deltamoe.serve.engine.sampling import SamplingParams


def _unsupported(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="unsupported_value")


# vLLM sampling extensions not implemented here, with the values that leave the output as it is.
NOT_IMPLEMENTED = {"min_tokens": (0,), "repetition_penalty": (1, 1.0), "length_penalty": (1, 1.0),
                   "use_beam_search": (False,), "bad_words": ([],), "allowed_token_ids": (),
                   "truncate_prompt_tokens": ()}


def _refuse_not_implemented(req: SamplingFields) -> None:
    for name, neutral in NOT_IMPLEMENTED.items():
        value = getattr(req, name)
        if value is not None and not any(value == v and type(value) is type(v) for v in neutral):
            raise _unsupported(name, f"{value!r} is not supported by this server (vLLM sampling extension)")


def _common(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
            stop_token_ids: list[int]) -> SamplingParams:
    _refuse_not_implemented(req)
    if req.stream_options is not None and not req.stream:  # as OpenAI and vLLM answer it
        raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options",
                       code="invalid_value")

    def pick(value, default):
        return default if value is None else value

    return SamplingParams(
        max_tokens=max_tokens, temperature=pick(req.temperature, 1.0), top_p=pick(req.top_p, 1.0),
        top_k=0 if req.top_k in (None, -1) else req.top_k,  # -1 is vLLM's "off"
        min_p=pick(req.min_p, 0.0), seed=req.seed, stop=list(req.stop),
        stop_token_ids=sorted(set(pick(req.stop_token_ids, [])) | set(stop_token_ids)),
        ignore_eos=req.ignore_eos, logprobs=logprobs, presence_penalty=pick(req.presence_penalty, 0.0),
        frequency_penalty=pick(req.frequency_penalty, 0.0), skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, logit_bias=_logit_bias(req.logit_bias))


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings); the range checks are SamplingParams.validate's."""
    if not bias:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise APIError(400, f"logit_bias: keys must be token ids, got {list(bias)[:4]}", param="logit_bias",
                       code="invalid_value") from None


def validated(params: SamplingParams, vocab_size: int, names: dict[str, str]) -> SamplingParams:
    """SamplingParams.validate, re-raised with the client's field name (see `field_names`)."""
    try:
        params.validate(vocab_size)
    except RequestError as e:
        raise rename(e, names) from e
    return params


def rename(e: RequestError, names: dict[str, str]) -> RequestError:
    return RequestError(str(e), field=names.get(e.field or "", e.field), hint=e.hint)


def completion_params(req: CompletionRequest, vocab_size: int) -> tuple[SamplingParams, dict[str, str]]:
    if req.suffix:
        raise _unsupported("suffix", "suffix (insertion) is not supported")
    names: dict[str, str] = {}
    params = _common(req, req.max_tokens, req.logprobs, [])
    params.prompt_logprobs = prompt_logprobs_count(req)  # echo with logprobs needs them too
    if req.prompt_logprobs is None and params.prompt_logprobs is not None:
        names["prompt_logprobs"] = "echo"  # what the client asked for, in errors about them
    return validated(params, vocab_size, names), names


def chat_params(req: ChatCompletionRequest, vocab_size: int,
                stop_token_ids: list[int]) -> tuple[SamplingParams, dict[str, str]]:
    for legacy, current in (("functions", "tools (type function)"), ("function_call", "tool_choice")):
        if getattr(req, legacy) is not None:
            raise _unsupported(legacy, f"OpenAI's deprecated form, not served: send {current}")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs=true", param="top_logprobs", code="invalid_value")
    names = {"logprobs": "top_logprobs", "prompt": "messages"}
    max_tokens = req.max_tokens
    if req.max_completion_tokens is not None:  # the newer name wins, as on api.openai.com
        max_tokens, names["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    turn_ends = [] if req.ignore_eos else stop_token_ids  # ignore_eos (benchmarks): run past end-of-turn too
    params = _common(req, max_tokens, logprobs, turn_ends)
    params.prompt_logprobs = req.prompt_logprobs  # vLLM's extension: the templated prompt's logprobs
    return validated(params, vocab_size, names), names
