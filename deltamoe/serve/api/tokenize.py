"""POST /tokenize and POST /detokenize, in vLLM's shapes.

/tokenize takes a `prompt` (the ids /v1/completions would feed the model) or chat `messages`
with optional `tools` and `chat_template_kwargs` (the ids /v1/chat/completions would feed it, an
image part's placeholder tokens included: the image is loaded under the server's image options to
count them); it answers {count, max_model_len, tokens, token_strs}. /detokenize takes {tokens} and answers
{prompt}, special tokens by name.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request

from deltamoe.serve.api.chat_request import ChatOptions
from deltamoe.serve.api.chat_template import ChatTemplate
from deltamoe.serve.api.errors import APIError
from deltamoe.serve.api.format import token_text
from deltamoe.serve.api.images import ImageOptions
from deltamoe.serve.api.schemas import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from deltamoe.serve.engine.async_engine import AsyncLLMEngine


def tokenize_router(engine: AsyncLLMEngine, template: ChatTemplate, check_model: Callable[[str], None],
                    read_body: Callable, image_options: ImageOptions = ImageOptions()) -> APIRouter:
    router = APIRouter()
    vocab_size = engine.model_config.vocab_size

    @router.post("/tokenize")
    async def tokenize(request: Request) -> TokenizeResponse:
        req = await read_body(request, TokenizeRequest)
        if req.model is not None:
            check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "prompt: send either `prompt` or `messages`", param="prompt", code="invalid_value")
        if req.prompt is not None:
            ids = engine.tokenizer.encode(req.prompt)
        else:
            ids, _ = await ChatOptions.of(req, template).encode_with_images(
                template, [m.model_dump() for m in req.messages], req.add_generation_prompt, engine.model_config,
                image_options)
        strs = [token_text(engine.tokenizer, t)[0] for t in ids] if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> DetokenizeResponse:
        req = await read_body(request, DetokenizeRequest)
        if req.model is not None:
            check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(400, f"tokens: {bad} is not a token id in [0, {vocab_size})", param="tokens",
                           code="invalid_value")
        try:
            return DetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens, skip_special_tokens=False))
        except ValueError as e:  # an id of a padded vocabulary that the tokenizer does not know
            raise APIError(400, f"tokens: {e}", param="tokens", code="invalid_value") from e

    return router
