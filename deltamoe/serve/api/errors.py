"""Every failure becomes an OpenAI-style error body: {"error": {"message", "type", "param", "code"}}.

Request faults are 4xx and name the field (`param`) the way the engine's `RequestError(field=...)`
does; anything unexpected is a 500 with the same shape, and the server (and the connection) keeps serving.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deltamoe.errors import RequestError
from deltamoe.serve.api.schemas import ErrorInfo, ErrorResponse

log = logging.getLogger("deltamoe.serve.api")

# An error names what was wrong, not all of it: a body of seventeen 1 MiB stop strings must not come
# back as a 17 MB error. Messages and field names are cut to these lengths.
MAX_MESSAGE_CHARS = 1024
MAX_PARAM_CHARS = 128

# OpenAI's `type` per status; 4xx faults are all "invalid_request_error" on api.openai.com.
_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """A failure the server reports as-is (status + OpenAI error fields)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        message, param = clip(message, MAX_MESSAGE_CHARS), None if param is None else clip(param, MAX_PARAM_CHARS)
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def clip(text: str, limit: int) -> str:
    """`text` cut to about `limit` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def from_request_error(e: RequestError) -> APIError:
    return APIError(400, e.one_line(), param=e.field, code="invalid_value")


def format_loc(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def from_validation_error(e: ValidationError | RequestValidationError) -> APIError:
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({err.get('ctx', {}).get('error', err['msg'])})",
                        code="invalid_json")
    loc = tuple(p for p in err["loc"] if p != "body")  # FastAPI prefixes body fields with "body"
    if not loc:
        return APIError(400, f"the request body must be a JSON object ({err['msg']})", code="invalid_type")
    param = format_loc(loc)
    msg = err["msg"].removeprefix("Value error, ")
    return APIError(400, f"{param}: {msg}", param=param, code=err["type"])


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestError)
    async def _request(_: Request, e: RequestError) -> JSONResponse:
        return from_request_error(e).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        return from_validation_error(e).response()

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return APIError(e.status_code, str(e.detail), code=code).response()


class InternalErrorMiddleware:
    """Answers an unexpected exception with a 500 error body and keeps the connection usable.

    Starlette's own last-resort handler re-raises after answering, so uvicorn drops the
    keep-alive connection and the client's next request on it fails; catching here avoids that.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:  # the client left; its own doing, not a server error (and no traceback)
            log.info("client left during %s", scope.get("path"))
            if not started:  # recorded as 499 by the metrics middleware; the send itself goes nowhere
                await APIError(499, "the client closed the connection", code="client_closed_request"
                               ).response()(scope, receive, send)
        except Exception as e:
            log.exception("unhandled error while serving %s", scope.get("path"))
            if started:  # half a response is out; nothing well-formed can follow it
                raise
            error = APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")
            await error.response()(scope, receive, send)
