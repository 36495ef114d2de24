"""Every ``tpserve`` failure a user can cause is one line that names the cause (by its flag) and the fix:
no traceback, whatever the command.

The port and file cases run the installed command in a process of its own, as a user does (a
traceback printed while the process exits is only visible there); the flag combinations call
``main`` in this process.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading

import grpc
import pytest

from launch.cli import main
from tests.e2e.cluster import free_port
from tests.in_process_server import generation_server
from tpserve.client import describe_rpc_error, with_default_port
from tpserve.cli import EXIT_STDOUT_CLOSED
from tpserve.embedded_model import default_model_dir
from tpserve.v1 import generate_pb2 as pb
from tpserve.v1 import generate_pb2_grpc

TPSERVE = [sys.executable, "-m", "launch.cli"]


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(TPSERVE + args, capture_output=True, text=True, timeout=timeout)


def _one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.fixture
def taken_port():
    """A port some other process listens on (this one), as a user's second server would find it."""
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _free_port() -> int:
    return free_port()  # outside the ephemeral range (tests/e2e/cluster.py)


def test_taken_metrics_port_is_one_line_naming_the_flag(taken_port):
    run = _run(["serve", "--port", str(_free_port()), "--metrics-port", str(taken_port)])
    assert run.returncode == 1
    line = _one_line(run.stderr)
    assert line.startswith(f"tpserve serve: --metrics-port {taken_port}: ") and "choose another --metrics-port" in line
    assert "listening" not in run.stdout + run.stderr  # refused before the public port opened


def test_taken_port_is_one_line_naming_the_flag(taken_port):
    run = _run(["serve", "--port", str(taken_port)])
    assert run.returncode == 1
    # gRPC's core would log its own bind failure (an add_port.cc E-line) before ours: silenced (tpserve/log.py)
    line = _one_line(run.stderr)
    assert line.startswith(f"tpserve serve: --port {taken_port}: ") and "choose another --port" in line


def test_two_of_its_own_ports_on_one_number_are_a_flag_error():
    """`--port P --metrics-port P`: refused before any bind, naming both flags, exit status 2 (the second bind said
    another process listened there, exit status 1)."""
    port = _free_port()
    run = _run(["serve", "--port", str(port), "--metrics-port", str(port)])
    assert run.returncode == 2
    assert _one_line(run.stderr) == f"tpserve serve: --metrics-port {port} is also --port; choose another --metrics-port"


def test_taken_store_port_names_it_and_the_master_port_flag():
    """A multi-host leader's rendezvous store port, --master-port + 1, taken: refused at start-up naming both ports and
    the flag (it was "rank 0: OSError: [Errno 98] Address already in use", after every node had joined and loaded)."""
    with socket.socket() as sock:
        for _ in range(20):
            master_port = _free_port()
            try:
                sock.bind(("0.0.0.0", master_port + 1))
                break
            except OSError:
                continue  # the next port is taken already: draw again
        sock.listen()
        run = _run(["serve", "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "0",
                    "--master-addr", "127.0.0.1", "--master-port", str(master_port), "--port", str(_free_port()),
                    "--worker-start-timeout-seconds", "20"], timeout=60)
    assert run.returncode == 1
    assert "Traceback" not in run.stderr and "waiting for nodes" not in run.stderr  # refused before any node joined
    (failed,) = [line for line in run.stderr.splitlines() if "start-up failed" in line]
    assert (f"--master-port {master_port}: the group's rendezvous store uses the next port, {master_port + 1}, and "
            "cannot bind it (Address already in use); stop the process that listens there or choose another "
            "--master-port") in failed


def test_missing_json_schema_file(tmp_path):
    run = _run(["generate", "--target", f"127.0.0.1:{_free_port()}", "--json-schema", f"@{tmp_path}/nope.json",
                "Hi"])
    assert run.returncode == 2
    assert _one_line(run.stderr) == (f"tpserve generate: --json-schema @{tmp_path}/nope.json: cannot read "
                                     f"{tmp_path}/nope.json (No such file or directory); give a JSON schema file "
                                     "after @, or the schema itself")


@pytest.mark.parametrize("draft, expected", [
    ("nope", "{draft}: no such directory (give a Hugging Face checkpoint directory)"),
    ("empty", "{draft}: not a Hugging Face checkpoint directory (no config.json)"),
])
def test_a_bad_draft_model_directory_names_speculative_model(tmp_path, draft, expected):
    """The draft's directory is named by its own flag: the message named --model, which was fine."""
    (tmp_path / "empty").mkdir()
    path = tmp_path / draft
    run = _run(["serve", "--port", str(_free_port()), "--model", str(default_model_dir()), "--speculative-method",
                "draft", "--speculative-model", str(path), "--num-speculative-tokens", "2"])
    assert run.returncode == 2
    assert _one_line(run.stderr) == "tpserve serve: --speculative-model " + expected.format(draft=path)


@pytest.mark.parametrize("command", ["generate", "info", "bench"])
@pytest.mark.parametrize("given, missing", [("--ssl-certfile", "--ssl-keyfile"), ("--ssl-keyfile", "--ssl-certfile")])
def test_a_client_certificate_without_its_key_is_a_flag_error(tmp_path, command, given, missing):
    """grpc's C core aborted the process on the first call (SIGABRT, exit 134) for a certificate without its key."""
    pem = tmp_path / "half.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    args = [command, "--target", f"127.0.0.1:{_free_port()}", given, str(pem)] + (["Hi"] if command == "generate"
                                                                                  else [])
    run = _run(args)
    assert run.returncode == 2, run.stderr
    assert _one_line(run.stderr) == (f"tpserve {command}: {given} needs {missing}: mutual TLS takes the client "
                                     "certificate and its key together")


def test_the_client_library_refuses_half_a_key_pair_before_any_call():
    from tpserve.client import Client, Credentials

    with pytest.raises(ValueError, match="ssl_certfile needs ssl_keyfile"):
        Client("127.0.0.1:1", credentials=Credentials(ssl_certfile="client.pem"))
    with pytest.raises(ValueError, match="ssl_keyfile needs ssl_certfile"):
        Credentials(ssl_ca_certs="ca.pem", ssl_keyfile="client.key")


def test_no_server_says_what_to_check():
    port = _free_port()
    run = _run(["generate", "--target", f"127.0.0.1:{port}", "Hi"])
    assert run.returncode == 1
    line = _one_line(run.stderr)
    assert line.startswith("UNAVAILABLE: ") and f"no tpserve server answers at 127.0.0.1:{port}" in line
    assert "start one (tpserve serve) or check --target" in line


@pytest.mark.parametrize("command", ["generate", "info", "bench"])
@pytest.mark.parametrize("target, problem", [
    ("127.0.0.1:abc", "the port 'abc' is not a number in 1-65535"),
    ("127.0.0.1:99999", "the port '99999' is not a number in 1-65535"),
    ("localhost:", "the port '' is not a number in 1-65535"),
    (":50051", "no host name before the port: give HOST:PORT"),
    ("http://127.0.0.1:50051", "is a URL; give HOST:PORT (a gRPC target has no http:// or grpc:// scheme)"),
])
def test_a_target_grpc_cannot_dial_is_a_flag_error_before_any_call(command, target, problem, capsys):
    """`--target 127.0.0.1:abc` was sent, failed UNAVAILABLE "errors resolving", and a unary generate retried it
    four times as a stream to continue; 99999 dialled port 34463 (99999 mod 65536)."""
    argv = [command, "--target", target] + (["Hi"] if command == "generate" else [])
    assert main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"tpserve {command}: --target {target}") and line.endswith(problem)


def test_the_client_library_refuses_a_target_grpc_cannot_dial():
    from tpserve.client import AsyncClient, Client

    with pytest.raises(ValueError, match=r"^127\.0\.0\.1:abc: the port 'abc' is not a number in 1-65535$"):
        Client("127.0.0.1:abc")

    async def make() -> None:
        AsyncClient("dns:///tpserve.svc:0")

    with pytest.raises(ValueError, match=r"^dns:///tpserve\.svc:0: the port '0' is not a number in 1-65535$"):
        asyncio.run(make())


def test_a_name_that_does_not_resolve_fails_at_once_naming_it():
    """It was retried four times, each line about continuing "the stream ... after 0 tokens"."""
    run = _run(["generate", "--target", "no-such-host.invalid:57051", "Hi"])
    assert run.returncode == 1
    line = _one_line(run.stderr)
    assert line.startswith("UNAVAILABLE: ") and "retrying" not in line
    assert line.endswith("-- the name no-such-host.invalid does not resolve: check --target HOST[:PORT]")


class _ChattyServer(generate_pb2_grpc.GenerationServicer):
    """A stream whose first word comes at once and the rest once ``rest`` is set; model info at once."""

    def __init__(self) -> None:
        self.rest = threading.Event()

    def GetModelInfo(self, request, context):
        return pb.ModelInfo(model_name="chatty", max_model_len=512)

    def GenerateStream(self, request, context):
        yield pb.GenerateStreamResponse(request_id="r", text="Once upon", token_ids=[1])
        self.rest.wait(30)
        for i in range(200):
            yield pb.GenerateStreamResponse(request_id="r", text=" a time", token_ids=[2 + i])
        yield pb.GenerateStreamResponse(request_id="r", text=".", token_ids=[9], finish_reason=pb.FINISH_REASON_LENGTH)


@pytest.fixture
def chatty():
    servicer = _ChattyServer()
    with generation_server(servicer) as target:
        try:
            yield servicer, target
        finally:
            servicer.rest.set()


def test_a_reader_that_closes_early_ends_the_command_quietly(chatty):
    """`tpserve generate --stream ... | head -c 5`, `tpserve info | head -1`: the reader gone, the command stops
    without a word and exits 128 + SIGPIPE, as a tool SIGPIPE ends (it printed "None: Broken pipe", exit status 2,
    documented as bad flags)."""
    servicer, target = chatty
    stream = subprocess.Popen(TPSERVE + ["generate", "--target", target, "--stream", "Once"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert stream.stdout.read(5) == b"Once "  # head -c 5
    stream.stdout.close()
    servicer.rest.set()  # the rest of the stream is printed to a pipe nobody reads
    info = subprocess.Popen(TPSERVE + ["info", "--target", target], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    info.stdout.close()  # gone before the first line
    for process in (stream, info):
        assert process.wait(timeout=60) == EXIT_STDOUT_CLOSED == 141
        assert process.stderr.read() == b""
        process.stderr.close()


@pytest.mark.parametrize("argv, expected", [
    (["serve", "--speculative-method", "ngram"],
     "tpserve serve: --speculative-method=ngram needs --num-speculative-tokens (>= 1)"),
    (["serve", "--prompt-lookup-min", "4", "--prompt-lookup-max", "2", "--speculative-method", "ngram",
      "--num-speculative-tokens", "2"], "tpserve serve: --prompt-lookup-min=4 must be <= --prompt-lookup-max=2"),
    (["serve", "--nnodes", "2"], "tpserve serve: --tensor-parallel-size=1 is not divisible by --nnodes=2"),
    (["serve", "--max-num-seqs", "0"], "tpserve serve: --max-num-seqs: Input should be greater than or equal to 1"),
    (["serve", "--port", "99999"], "tpserve serve: --port: Input should be less than or equal to 65535"),
    (["serve", "--otlp-traces-endpoint", "http://127.0.0.1:99999"],
     "tpserve serve: --otlp-traces-endpoint: http://127.0.0.1:99999 needs a port in 1-65535"),
    (["serve", "--otlp-traces-endpoint", "ftp://x:1"],
     "tpserve serve: --otlp-traces-endpoint: ftp://x:1 is not OTLP over gRPC (scheme ftp): give http://HOST:PORT, "
     "https://HOST:PORT (TLS), grpc://HOST:PORT or HOST:PORT"),
    (["serve", "--otlp-traces-endpoint", "notaurl"],
     "tpserve serve: --otlp-traces-endpoint: notaurl is not a collector's address: give http://HOST:PORT, "
     "https://HOST:PORT (TLS), grpc://HOST:PORT or HOST:PORT"),
    (["serve", "--config", "/nonexistent/tpserve.yaml"],
     "tpserve serve: --config /nonexistent/tpserve.yaml: No such file or directory"),
    (["serve", "--num-scheduler-steps", "4", "--async-scheduling"],
     "tpserve serve: --num-scheduler-steps 4 does not combine with --async-scheduling (both run the ranks ahead of "
     "the coordinator: a plan of several steps on the ranks, async scheduling by planning a step before the last "
     "one's result; the scheduler does one or the other)"),
    (["generate", "--logprobs", "Hi"], "tpserve generate: --logprobs is printed only in the JSON object: add --json"),
    (["generate", "--json", "--top-logprobs", "2", "Hi"],
     "tpserve generate: --top-logprobs goes with --logprobs: add --logprobs"),
    (["generate", "--system", "Be brief.", "Hi"],
     "tpserve generate: --system goes with --chat (a system message before the prompt): add --chat"),
    (["generate", "--ssl-ca-certs", "/nonexistent/ca.pem", "Hi"],
     "tpserve generate: /nonexistent/ca.pem: No such file or directory"),
])
def test_flag_errors_are_one_line_naming_flags(argv, expected, capsys, monkeypatch):
    # serve configures logging for the whole process (to this test's captured stderr): not here
    monkeypatch.setattr("tpserve.log.configure_logging", lambda *args, **kwargs: None)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert _one_line(captured.err) == expected
    assert "_" not in expected.split(": ", 1)[1].split(" ")[0], "a YAML key where a flag was meant"


@pytest.mark.parametrize("text, expected", [
    (b"server: {port: 53060\n", "line 2, column 1: expected ',' or '}', but got '<stream end>'"),
    (b"server:\n  port: 1\n bad: 2\n", "line 3, column 2: expected <block end>, but found '<block mapping start>'"),
    (b"server:\n  host: \xc3(\n", "position 16: unacceptable character #x00c3: invalid continuation byte"),
    (b"- server\n", "expected a mapping of sections, got list"),
    (b"server: 5\n", "section server: expected a mapping of fields, got int"),
])
def test_a_malformed_config_file_is_one_line_naming_it(text, expected, tmp_path, capsys, monkeypatch):
    """A --config file PyYAML cannot parse: one line naming the file and where parsing stopped, exit status 2 (it was
    a 56-line traceback naming "<unicode string>", exit status 1)."""
    monkeypatch.setattr("tpserve.log.configure_logging", lambda *args, **kwargs: None)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_bytes(text)
    assert main(["serve", "--config", "bad.yaml"]) == 2
    assert _one_line(capsys.readouterr().err) == f"tpserve serve: --config bad.yaml: {expected}"


@pytest.mark.parametrize("argv, expected", [
    (["serve", "--quantization", "foo"], "tpserve serve: argument --quantization: invalid choice: 'foo' (choose from "
                                         "'int8', 'int4', 'fp8') (`tpserve serve --help` lists the flags)"),
    (["serve", "--no-such-flag"], "tpserve: unrecognized arguments: --no-such-flag (`tpserve --help` lists the flags)"),
    (["generate"], "tpserve generate: the following arguments are required: prompt "
                   "(`tpserve generate --help` lists the flags)"),
])
def test_argparse_errors_are_one_line_without_the_usage(argv, expected, capsys):
    """argparse's own errors: one line naming the flag and where the flags are listed, not 55 lines of usage."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert _one_line(capsys.readouterr().err) == expected


@pytest.mark.parametrize("target, expected", [
    ("127.0.0.1", "127.0.0.1:50051"), ("localhost", "localhost:50051"), ("::1", "[::1]:50051"),
    ("[::1]", "[::1]:50051"), ("[::1]:7", "[::1]:7"), ("host:7", "host:7"),
    ("dns:///tpserve.svc:50051", "dns:///tpserve.svc:50051"),
    ("ipv4:10.0.0.1:5,10.0.0.2:5", "ipv4:10.0.0.1:5,10.0.0.2:5"),
    ("unix:///tmp/s", "unix:///tmp/s"),
])
def test_target_host_alone_means_port_50051(target, expected):
    assert with_default_port(target) == expected


class _RpcError(grpc.RpcError):
    """A failed call as grpc raises it: a status code and the details text gRPC's core wrote."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize("code, details, tls, hint", [
    (grpc.StatusCode.UNAVAILABLE, "Socket closed", False, "if it was started with --ssl-certfile, connect with TLS"),
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50051: "
     "Ssl handshake failed: SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER", True,
     "the TLS handshake with 127.0.0.1:50051 failed: check --ssl-ca-certs"),
    (grpc.StatusCode.UNAUTHENTICATED, "missing authorization: Bearer <key>", False, "--api-key or $TPSERVE_API_KEY"),
])
def test_rpc_failures_say_what_to_check(code, details, tls, hint):
    line = describe_rpc_error(_RpcError(code, details), "127.0.0.1:50051", tls=tls)
    assert line.startswith(f"{code.name}: {details} -- ") and hint in line
