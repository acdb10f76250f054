"""The optional API key of `deltamoe serve` and `deltamoe router`: clients send `Authorization: Bearer <key>`.

Light to import (FastAPI comes in with `bearer_check`): the CLIs check the option before anything loads.
"""

import os
import secrets
from typing import Awaitable, Callable

from deltamoe.errors import ConfigError


def check_api_key_option(api_key: str | None) -> str | None:
    """An empty key (`--api-key "$KEY"` with KEY unset) would lock out every client that sends none, as
    the openai client cannot send an empty one: refused at start-up, never taken as "no key"."""
    if api_key is not None and not api_key.strip():
        raise ConfigError("empty API key", field="api_key", hint="omit --api-key and DELTAMOE_API_KEY for no key")
    return api_key


def check_api_key_env(api_key: str | None) -> None:
    """`DELTAMOE_API_KEY=$SECRET` with SECRET unset: the CLI's option parser reads an empty variable as
    no variable, so the server would start open to anyone. Refused at start-up, as an empty --api-key is."""
    if api_key is None and "DELTAMOE_API_KEY" in os.environ:
        raise ConfigError("DELTAMOE_API_KEY is set but empty: the server would start with no key",
                          field="DELTAMOE_API_KEY", hint="set it to the key, or unset it for no key")


def bearer_check(api_key: str | None) -> Callable[..., Awaitable[None]]:
    """A FastAPI dependency: 401 unless the request carries the key (nothing to check when there is none)."""
    from fastapi import Request  # a real annotation below: FastAPI reads it to pass the request in

    from deltamoe.serve.api.errors import APIError

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not tell an attacker how much of the key matched.
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    return check_key
