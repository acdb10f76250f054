"""`deltamoe router`: the OpenAI front of prefill and decode servers (started with --role)."""

from __future__ import annotations

from typing import Optional

import typer


def router_command(
    prefill: list[str] = typer.Option(..., "--prefill", help="A prefill server's URL; repeat for several."),
    decode: list[str] = typer.Option(..., "--decode", help="A decode server's URL; repeat for several."),
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    port: int = typer.Option(8000, min=1, max=65535),
    api_key: Optional[str] = typer.Option(None, envvar="DELTAMOE_API_KEY",
                                          help="Asked of clients on /v1 and sent to the workers (start them with "
                                               "the same key)."),
    max_retries: int = typer.Option(2, min=0, help="Tries on another pair after a worker fails a request."),
    read_timeout: float = typer.Option(60.0, min=0.1, help="Seconds to wait for a stream's next event. A "
                                       "worker's first answer (after its prefill) and a whole non-streamed answer "
                                       "wait as long as the worker answers the router's health polls."),
    log_level: str = typer.Option("info"),
) -> None:
    """Route OpenAI requests through prefill/decode server pairs (retries on a dead worker)."""
    from deltamoe.serve.api.auth import check_api_key_env, check_api_key_option
    from deltamoe.serve.cli import bind_listen_address
    from deltamoe.serve.router.workers import WorkerPool

    check_api_key_option(api_key)
    check_api_key_env(api_key)

    pool = WorkerPool(list(prefill), list(decode))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    pool.check(headers)  # refused here, in one line, before the port opens
    listener = bind_listen_address(host, port)
    from deltamoe.serve.router.app import run

    typer.echo(f"router: {len(prefill)} prefill + {len(decode)} decode servers, model {pool.model!r}", err=True)
    run(pool, host, port, sock=listener, log_level=log_level, api_key=api_key, max_retries=max_retries,
        read_timeout_s=read_timeout)
