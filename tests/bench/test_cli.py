"""``tpserve bench``'s own failures, as a user meets them: files it cannot read, Ctrl-C mid-load, requests the
server refused. The command runs in a process of its own (a traceback, an exit status and a SIGINT are only
seen there), against an in-process server that answers the health check and model info and streams as the
prompt says."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

from tests.e2e.cluster import free_port
from tests.in_process_server import generation_server
from tpserve.v1 import generate_pb2 as pb
from tpserve.v1 import generate_pb2_grpc

TPSERVE = [sys.executable, "-m", "launch.cli"]


class _PromptedServer(generate_pb2_grpc.GenerationServicer):
    """GenerateStream by prompt: "fast" ends at once, "slow" sends a token and waits (until stopped), "bad" is
    refused with INVALID_ARGUMENT."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.num_slow = 0

    def GetModelInfo(self, request, context):
        return pb.ModelInfo(model_name="prompted", max_model_len=512, vocab_size=32)

    def GenerateStream(self, request, context):
        if request.text == "bad":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.temperature must be >= 0, got -1")
        yield pb.GenerateStreamResponse(request_id="r", text="a", token_ids=[1])
        if request.text == "slow":
            self.num_slow += 1
            self.stop.wait(60)
        yield pb.GenerateStreamResponse(request_id="r", text="b", token_ids=[2], finish_reason=pb.FINISH_REASON_LENGTH,
                                        usage=pb.Usage(prompt_tokens=1, completion_tokens=2))


@pytest.fixture
def prompted():
    servicer = _PromptedServer()
    with generation_server(servicer, with_health=True, num_threads=16) as target:
        try:
            yield servicer, target
        finally:
            servicer.stop.set()


def _dataset(tmp_path, prompts: list[str]) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": prompt, "max_tokens": 2}) + "\n" for prompt in prompts))
    return str(path)


def _sigint_default() -> None:
    """In the child, before exec: Ctrl-C's default. A SIGINT ignored in the test process (SIG_IGN survives exec)
    would be ignored by the command too: once in a full run, both Ctrl-C tests saw no interrupt at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _bench(*args: str) -> list[str]:
    return TPSERVE + ["bench", "--disable-tqdm", "--ready-check-timeout-sec", "60", *args]


@pytest.mark.parametrize("flag", ["--dataset-path", "--ssl-ca-certs"])
def test_a_file_that_cannot_be_read_is_one_line_exit_2_before_the_server_is_called(tmp_path, flag):
    """Both were a FileNotFoundError traceback, exit status 1; the dataset was read only after the server
    answered, so against no server a typo cost the whole --ready-check-timeout-sec first."""
    missing = str(tmp_path / "missing")
    args = ["--target", f"127.0.0.1:{free_port()}", "--dataset", "jsonl", "--dataset-path",
            _dataset(tmp_path, ["fast"]), flag, missing]  # the last --dataset-path wins
    started = time.monotonic()
    run = subprocess.run(_bench(*args), capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < 30  # not the 60 s ready check
    assert run.returncode == 2
    assert run.stderr == f"tpserve bench: {missing}: No such file or directory\n"


def test_a_dataset_that_is_not_text_is_one_line_naming_it(tmp_path):
    path = tmp_path / "binary.jsonl"
    path.write_bytes(b'{"prompt": "\xff"}\n')
    run = subprocess.run(_bench("--target", f"127.0.0.1:{free_port()}", "--dataset", "jsonl", "--dataset-path",
                                str(path)), capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr == f"tpserve bench: {path}: not UTF-8 text (byte 12)\n"


def test_ctrl_c_mid_load_prints_what_ended_and_exits_130(prompted, tmp_path):
    """It was a 20-line KeyboardInterrupt traceback and no table."""
    servicer, target = prompted
    dataset = _dataset(tmp_path, ["fast", "fast", "fast", "slow", "slow"])
    bench = subprocess.Popen(_bench("--target", target, "--dataset", "jsonl", "--dataset-path", dataset,
                                    "--num-prompts", "5"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=_sigint_default)
    deadline = time.monotonic() + 60
    while servicer.num_slow < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert servicer.num_slow == 2
    time.sleep(0.5)  # the fast ones' ends reach the client
    bench.send_signal(signal.SIGINT)
    out, err = bench.communicate(timeout=60)
    assert bench.returncode == 130
    assert "Traceback" not in err and err == "tpserve bench: interrupted: the table counts the 3 of 5 requests that had ended\n"
    assert "Successful requests:                    3" in out and "Failed requests:                        0" in out


def test_ctrl_c_before_the_load_exits_130_quietly(tmp_path):
    with socket.socket() as silent:  # accepts connections, never answers: the ready check waits
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        bench = subprocess.Popen(_bench("--target", f"127.0.0.1:{silent.getsockname()[1]}"),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_default)
        silent.settimeout(60)
        connection, _ = silent.accept()  # the ready check has begun (a fixed sleep raced the start on a busy host)
        bench.send_signal(signal.SIGINT)
        out, err = bench.communicate(timeout=60)
        connection.close()
    assert (bench.returncode, out, err) == (130, "", "")


def test_the_table_gives_the_servers_first_message_for_each_failing_code(prompted, tmp_path):
    """Only "failed with INVALID_ARGUMENT: 2" was printed, never what the server refused."""
    _, target = prompted
    run = subprocess.run(_bench("--target", target, "--dataset", "jsonl", "--dataset-path",
                                _dataset(tmp_path, ["bad", "fast"]), "--num-prompts", "4"),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    at = lines.index("  failed with INVALID_ARGUMENT:         2")
    assert lines[at + 1] == "    first message: sampling_params.temperature must be >= 0, got -1"


@pytest.mark.parametrize("flags, message", [
    (["--request-rate", "-1"], "--request-rate must be > 0 (or inf), got -1"),
    (["--burstiness", "0"], "--burstiness must be a finite number > 0, got 0"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1"),
    (["--request-timeout", "0"], "--request-timeout must be > 0 seconds, got 0"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1, got 0"),
])
def test_a_bad_load_flag_is_one_line_exit_2_before_the_server_is_called(flags, message):
    """--request-rate -1 waited the whole ready check for an absent server; --temperature -1 ran the whole load,
    every request refused."""
    started = time.monotonic()
    run = subprocess.run(_bench("--target", f"127.0.0.1:{free_port()}", *flags), capture_output=True, text=True,
                         timeout=120)
    assert time.monotonic() - started < 30 and run.returncode == 2
    assert run.stderr == f"tpserve bench: {message}\n"


def test_the_result_file_holds_no_api_key(prompted, tmp_path):
    """Result files get shared (benchmarks/results): the bearer key was written with the other flags."""
    _, target = prompted
    result = tmp_path / "result.json"
    run = subprocess.run(_bench("--target", target, "--dataset", "jsonl", "--dataset-path", _dataset(tmp_path, ["fast"]),
                                "--api-key", "SECRET-KEY-123", "--result-file", str(result)),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    parameters = json.loads(result.read_text())["parameters"]
    assert "SECRET-KEY-123" not in result.read_text() and "api_key" not in parameters
    assert parameters["dataset"] == "jsonl"
