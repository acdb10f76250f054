"""The published OpenAPI document: the real request models of the routes that read their body by hand.

The completion routes read and validate their body themselves (size limit first, strict types,
OpenAI-style errors), so FastAPI cannot see their request models; this adds them, with their
response and error models, so schema-driven clients and fuzzers get the real contract.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from deltamoe.serve.api.schemas import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                        CompletionResponse, DetokenizeRequest, DetokenizeResponse, ErrorResponse,
                                        TokenizeRequest, TokenizeResponse)

REF = "#/components/schemas/{model}"
ERROR_STATUSES = ("400", "401", "404", "408", "413")
BODY_ROUTES: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "/v1/completions": (CompletionRequest, CompletionResponse),
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse),
    "/tokenize": (TokenizeRequest, TokenizeResponse),
    "/detokenize": (DetokenizeRequest, DetokenizeResponse),
}
STREAMING_ROUTES = ("/v1/completions", "/v1/chat/completions")


def _add(components: dict[str, Any], model: type[BaseModel], mode: str) -> dict[str, str]:
    """Put `model` (and the models it uses) into components; a $ref to it."""
    schema = model.model_json_schema(ref_template=REF, mode=mode)
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": REF.format(model=model.__name__)}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            components = doc.setdefault("components", {}).setdefault("schemas", {})
            error = _add(components, ErrorResponse, "serialization")
            for path, (request, response) in BODY_ROUTES.items():
                op = doc["paths"][path]["post"]
                op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _add(
                    components, request, "validation")}}}
                content = {"application/json": {"schema": _add(components, response, "serialization")}}
                if path in STREAMING_ROUTES:
                    content["text/event-stream"] = {"schema": {"type": "string"}}
                op["responses"] = {
                    "200": {"description": "The completion; with stream=true, server-sent events of chunks."
                            if path in STREAMING_ROUTES else "The result.", "content": content},
                    **{s: {"description": "An OpenAI-style error.", "content": {"application/json": {"schema": error}}}
                       for s in ERROR_STATUSES},
                }
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
