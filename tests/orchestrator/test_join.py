"""``cemlab join``: what a joining host lacks is one line before anything starts; what it
finds itself (its address, its Gloo interface, a node-local home) is right."""

import argparse
import socket

import pytest

from orchestrator.cli import main
from orchestrator.execution import join


@pytest.fixture
def head():
    """A listening socket on 127.0.0.1 standing in for the head's Ray address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


def refused(capsys, *args: str) -> str:
    assert main(["join", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_missing_piece_is_one_line_and_nothing_starts(head, tmp_path, monkeypatch, capsys):
    for name in ("RAY_AUTH_TOKEN_PATH", "CEMLAB_STORAGE", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert "is not HOST:PORT" in refused(capsys, "10.0.0.5")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    assert refused(capsys, closed).startswith(f"error: cemlab join: the head {closed} does "
                                              "not answer")
    assert "no cluster token: copy the head's $CEMLAB_HOME/ray_auth_token" in refused(
        capsys, head)
    empty = tmp_path / "token"
    empty.write_text("\n")
    assert f"the token file {empty} is empty" in refused(capsys, head, "--token-file",
                                                          str(empty))
    token = tmp_path / "ray_auth_token"
    token.write_text("secret\n")
    monkeypatch.setenv("CEMLAB_STORAGE", "s3://bucket/lab")
    err = refused(capsys, head, "--token-file", str(token))
    assert err.endswith("the storage root s3://bucket/lab needs AWS_ACCESS_KEY_ID and "
                        "AWS_SECRET_ACCESS_KEY in this host's environment")
    assert "secret" not in err


def test_the_node_finds_its_address_interface_and_a_node_local_home(head, tmp_path,
                                                                     monkeypatch):
    monkeypatch.delenv("CEMLAB_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    token = tmp_path / "ray_auth_token"
    token.write_text("secret\n")
    host, port = join.head_address(head)
    address = join.reach_head(host, port)
    assert address == "127.0.0.1"  # the end this host routes to the head by
    args = argparse.Namespace(home=None, token_file=str(token))
    env = join.node_environment(args, address)
    assert env["CEMLAB_HOME"] == str(tmp_path / "cache" / "cemlab")
    assert env["GLOO_SOCKET_IFNAME"] == join.interface_of("127.0.0.1")
    assert (env["RAY_AUTH_MODE"], env["RAY_AUTH_TOKEN_PATH"]) == ("token", str(token))
    with pytest.raises(join.ServiceError, match="no interface of this host holds 192.0.2.7"):
        join.interface_of("192.0.2.7")
