"""`deltamoe serve` checks its address before the model loads: a port out of range, a port in use,
a host that does not resolve or is not this machine's are one line and exit code 2."""

from __future__ import annotations

import socket

import pytest

from deltamoe.cli import main
from deltamoe.errors import ConfigError
from deltamoe.serve.cli import bind_listen_address


def test_a_port_in_use_is_named(capsys) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "tiny", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: port: 127.0.0.1:{port} is already in use " \
                  "(hint: pick another --port or stop the process that holds it)\n"


def test_a_free_port_is_bound_and_held_for_the_server() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sock = bind_listen_address("127.0.0.1", port)
    try:
        assert sock.getsockname() == ("127.0.0.1", port)
        with socket.socket() as rival, pytest.raises(OSError):  # nobody takes it while the model loads
            rival.bind(("127.0.0.1", port))
    finally:
        sock.close()


@pytest.mark.parametrize("port", ["0", "65536", "99999", "-1"])
def test_ports_outside_1_to_65535_are_usage_errors(port: str, capsys) -> None:
    assert main(["serve", "tiny", "--port", port]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--port" in err and "(see 'deltamoe serve --help')" in err


def test_bad_hosts_name_the_host_field() -> None:
    with pytest.raises(ConfigError, match="cannot resolve 'no-such-host.invalid'") as error:
        bind_listen_address("no-such-host.invalid", 8000)
    assert error.value.field == "host"
    with pytest.raises(ConfigError, match="not an address of this machine") as error:
        bind_listen_address("192.0.2.1", 8000)  # TEST-NET-1: documentation only, never local
    assert error.value.field == "host"


def test_serve_process_answers_on_the_port_it_bound_and_stops_on_sigterm(serve_process) -> None:
    """The real command end to end: bind first, load, serve on that socket, exit cleanly on SIGTERM."""
    import signal

    import httpx

    with serve_process(["tiny", "--threads", "1", "--cache-memory", "64MiB", "--log-level", "warning"]) as (proc, url):
        assert httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"] == "tiny"
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught (exit status -SIGTERM)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert "Traceback" not in proc.stderr.read().decode()
