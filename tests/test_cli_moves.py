"""``tpserve generate``'s lines about a moving stream (tpserve/stream_move.py): each on a line of its own,
"retrying on ADDRESS" where the target has one address, "another replica" only where it has several, and a
final line that says it gave up after its tries."""

from __future__ import annotations

import socket

import grpc
import pytest

from tpserve import cli, generate_command
from tpserve.stream_move import StreamMove


def _move(attempt: int) -> StreamMove:
    return StreamMove("req-1", attempt, 496, grpc.StatusCode.UNAVAILABLE, "Socket closed", 0.15)


@pytest.mark.parametrize("target, count", [
    ("127.0.0.1:50051", 1), ("ipv4:127.0.0.1:1,127.0.0.2:1", 2), ("unix:///tmp/tpserve.sock", 1),
    ("no-such-host.invalid:1", 0), ("[::1]:7", 1),
])
def test_addresses_of_a_target(target, count):
    assert generate_command.num_addresses(target) == count


def test_one_address_is_retried_on_a_line_of_its_own(capsys, monkeypatch):
    reporter = generate_command.MoveReporter("127.0.0.1:7", stream=True)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    reporter.printed("Once upon a time, there was")  # the streamed text so far: no newline
    reporter(_move(1))
    reporter(_move(2))
    err = capsys.readouterr().err
    assert err == ("\ntpserve generate: UNAVAILABLE (Socket closed); retrying on 127.0.0.1:7 after 496 tokens "
                   "(attempt 1, in 0.1 s)\n"
                   "tpserve generate: UNAVAILABLE (Socket closed); retrying on 127.0.0.1:7 after 496 tokens "
                   "(attempt 2, in 0.1 s)\n")
    assert reporter.moves == 2


def test_several_addresses_continue_on_another_replica(capsys):
    reporter = generate_command.MoveReporter("ipv4:127.0.0.1:7,127.0.0.2:7", stream=True)
    reporter.printed("text")
    reporter(_move(1))  # stdout is not a terminal here: nothing is glued, no newline is added
    assert capsys.readouterr().err.startswith("tpserve generate: UNAVAILABLE (Socket closed); continuing on another "
                                              "replica after 496 tokens (attempt 1")


@pytest.mark.parametrize("stream", [True, False])
def test_the_last_line_says_the_request_stopped(capsys, monkeypatch, stream):
    """A unary call's lines say nothing of a stream or of tokens delivered: the whole request is sent again (they
    spoke of continuing "the stream ... after 0 tokens")."""
    class Lost(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "Socket closed"

    def run_generate(args, sampling, reporter):
        reporter(_move(1) if stream else StreamMove("req-1", 1, 0, grpc.StatusCode.UNAVAILABLE, "Socket closed", 0.15))
        raise Lost()

    monkeypatch.setattr(generate_command, "run_generate", run_generate)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = cli.build_parser().parse_args(["generate", "--target", f"127.0.0.1:{port}", "Hi"] + ["--stream"] * stream)
    assert cli.run_client_command(args) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[1].startswith("UNAVAILABLE: Socket closed -- ")
    if stream:
        assert f"retrying on 127.0.0.1:{port} after 496 tokens (attempt 1" in lines[0]
        assert lines[1].endswith("(gave up after 1 tries to continue the stream)")
    else:
        assert lines[0] == (f"tpserve generate: UNAVAILABLE (Socket closed); retrying on 127.0.0.1:{port} "
                            "(attempt 1, in 0.1 s)")
        assert lines[1].endswith("(gave up after 1 retry)")


def test_a_failed_stream_s_error_starts_a_line_of_its_own(capsys, monkeypatch):
    """A stream that fails mid-line (its deadline passed): the error is not glued to the streamed text."""
    class Late(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.DEADLINE_EXCEEDED

        def details(self):
            return "Deadline Exceeded"

    def run_generate(args, sampling, reporter):
        reporter.printed("Once upon a time, he wr")
        raise Late()

    monkeypatch.setattr(generate_command, "run_generate", run_generate)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    args = cli.build_parser().parse_args(["generate", "--target", "127.0.0.1:7", "--stream", "Hi"])
    assert cli.run_client_command(args) != 0
    err = capsys.readouterr().err
    assert err.startswith("\nDEADLINE_EXCEEDED: Deadline Exceeded"), err  # before: "...he wrDEADLINE_EXCEEDED"
