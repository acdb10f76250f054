"""`deltamoe serve` checks its address before the model loads: a port out of range, a port in use,
a host that does not resolve or is not this machine's are one line and exit code 2."""

from __future__ import annotations

import socket

import pytest

from deltamoe.cli import main
from deltamoe.errors import ConfigError
from deltamoe.serve.cli import check_listen_address


def test_a_port_in_use_is_named(capsys) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "tiny", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: port: 127.0.0.1:{port} is already in use " \
                  "(hint: pick another --port or stop the process that holds it)\n"


def test_a_free_port_passes_and_stays_free() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    check_listen_address("127.0.0.1", port)
    with socket.socket() as again:  # the check released it for uvicorn
        again.bind(("127.0.0.1", port))


@pytest.mark.parametrize("port", ["0", "65536", "99999", "-1"])
def test_ports_outside_1_to_65535_are_usage_errors(port: str, capsys) -> None:
    assert main(["serve", "tiny", "--port", port]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--port" in err and "(see 'deltamoe serve --help')" in err


def test_bad_hosts_name_the_host_field() -> None:
    with pytest.raises(ConfigError, match="cannot resolve 'no-such-host.invalid'") as error:
        check_listen_address("no-such-host.invalid", 8000)
    assert error.value.field == "host"
    with pytest.raises(ConfigError, match="not an address of this machine") as error:
        check_listen_address("192.0.2.1", 8000)  # TEST-NET-1: documentation only, never local
    assert error.value.field == "host"
