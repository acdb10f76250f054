"""The OpenAI wire format as pydantic models: requests (strictly typed) and responses.

Requests are strict about types (a JSON string where a number belongs is a 400, not a silent
cast) and ignore fields they do not know, as OpenAI's own clients send extras freely. Value
ranges are not repeated here: `SamplingParams.validate` owns them and names the field. Fields
that OpenAI defines but this server cannot honour are accepted only at their neutral value,
so a client never gets a silently different behaviour.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, field_validator, model_serializer

# torch.Generator.manual_seed takes any value that fits in 64 bits, signed or not.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extension: usage so far on every chunk


class SamplingFields(_Request):
    """What completions and chat share. None means "the default" (clients often send explicit nulls)."""

    model: str | None = None  # None: the served model (as vLLM; OpenAI requires it)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension; -1 means off there, 0 here
    min_p: float | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    # str | list[str]: checked below so the error names `stop`, not a union branch; the schema says the shape.
    stop: Any = Field(None, validate_default=True, json_schema_extra={"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]})
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None  # vLLM extension: the prompt's logprobs (top n), computed in prefill
    user: str | None = None
    metadata: dict[str, str] | None = None  # accepted and not used, as OpenAI stores it with the request
    # Structured outputs (serve/structured/request.py reads them): vLLM's current name and its older ones.
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's sampling extensions this server does not implement: read so that a value that would change
    # the output is refused (params.py), not dropped as an unknown field would be.
    min_tokens: Any = None
    repetition_penalty: Any = None
    length_penalty: Any = None
    use_beam_search: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    truncate_prompt_tokens: Any = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> list[str]:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise ValueError("expected a string or a list of strings")


class CompletionRequest(SamplingFields):
    # str | [str] | [int] | [[int]]: one prompt (str or ids), or several as a tuple (see `_prompt`)
    prompt: Any = Field(json_schema_extra={"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "integer"}, "minItems": 1},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1}, "minItems": 1}]})
    max_tokens: int | None = 16  # OpenAI's completions default
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None  # as vLLM: structured output for completions too

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int] | tuple[str | list[int], ...]:
        """One prompt as a string or token ids; several (OpenAI's batch) as a tuple of them."""
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str):
            return v
        if ids(v) and v:
            return v
        if isinstance(v, list) and len(v) == 1 and (isinstance(v[0], str) or ids(v[0])):
            return v[0]
        if isinstance(v, list) and len(v) > 1 and (all(isinstance(p, str) for p in v) or all(ids(p) for p in v)):
            return tuple(v)
        raise ValueError("expected a string, a list of token ids, or a list of either")

    @property
    def prompts(self) -> list[str | list[int]]:
        return list(self.prompt) if isinstance(self.prompt, tuple) else [self.prompt]


class ChatMessage(_Request):
    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: Any = None  # str | [{"type": "text", "text": ...}] | None: chat_template.normalize_messages checks it
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # chat's default: up to the context length
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # checked by tool_request.py, so errors name tools[i].function.name
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # template variables, e.g. {"thinking": false}
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last message is left open and the output continues it
    functions: Any = None  # OpenAI's deprecated form of tools: refused with a pointer (chat_params), not ignored
    function_call: Any = None


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a `prompt`, or chat `messages` (+ tools, template kwargs) rendered as chat would."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class _Choice(BaseModel):
    index: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's extra: the stop string or token id that ended it


class _Envelope(BaseModel):
    """What every completion object carries besides `object` and its choices."""

    id: str
    created: int
    model: str
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's extension, when asked


class CompletionResponse(_Envelope):  # also each streamed chunk, as on api.openai.com
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str  # Kimi's own: functions.NAME:IDX
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(ToolCallOut):  # a streamed call arrives whole, in one delta
    index: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Choice):
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's extension, when asked


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # OpenAI sends the role once, in the first delta, and leaves the key out afterwards.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Choice):
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # the first chunk's, when asked

    @model_serializer(mode="wrap")
    def _omit_absent_prompt_logprobs(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Only the first chunk of a request that asked carries the key; the others stay as they were.
        out = handler(self)
        if out.get("prompt_logprobs") is None:
            out.pop("prompt_logprobs", None)
        return out


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "deltamoe"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
