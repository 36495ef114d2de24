"""Run the Shepherd Model Gateway (``smg`` from PyPI) in front of real tpserve replicas, for tests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.e2e.cluster import free_port

START_TIMEOUT_S = 60.0
#: A chat template for stories260k (which has none), so that the gateway's chat rendering
#: and ours can be compared: the test model's tokenizer_config.json carries it.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def model_with_chat_template(model_dir: Path, into: Path) -> Path:
    """A directory that links every file of ``model_dir`` but a tokenizer_config.json with :data:`CHAT_TEMPLATE`."""
    into.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.name != "tokenizer_config.json":
            (into / path.name).symlink_to(path)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (into / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return into


def as_gateway_decodes(text: str) -> str:
    """The gateway decodes a completion's tokens on their own, where we decode them after the
    prompt's: stories260k's SentencePiece decoder then drops the space that starts a first
    token (" saw" decodes to "saw"). The token ids are the same."""
    return text.removeprefix(" ")


@dataclass
class RunningGateway:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def workers(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.base_url}/workers", timeout=5) as response:
            return json.load(response)["workers"]


@contextmanager
def run_gateway(worker_targets: list[str], log_path: Path, *extra: str) -> Iterator[RunningGateway]:
    """``smg launch --backend vllm`` over ``worker_targets`` (``host:port``) until the block exits;
    returns once every worker is registered and healthy.

    Raises:
        RuntimeError: smg is not installed, exits, or does not register the workers in time.
    """
    with _run_smg(["--worker-urls", *(f"grpc://{t}" for t in worker_targets), *extra], len(worker_targets),
                  log_path) as gateway:
        yield gateway


@contextmanager
def run_pd_gateway(prefill_targets: list[str], decode_targets: list[str], log_path: Path,
                   *extra: str) -> Iterator[RunningGateway]:
    """``smg launch --backend vllm --pd-disaggregation`` with these prefill and decode replicas
    (``host:port``): each request goes to a prefill replica first, then to a decode replica with the
    prefill's kv_transfer_params_json (docs/design/cluster.md, "Prefill/decode disaggregation").

    Raises:
        RuntimeError: as :func:`run_gateway`.
    """
    args = ["--pd-disaggregation"]
    for target in prefill_targets:
        args += ["--prefill", f"grpc://{target}"]
    for target in decode_targets:
        args += ["--decode", f"grpc://{target}"]
    with _run_smg([*args, *extra], len(prefill_targets) + len(decode_targets), log_path) as gateway:
        yield gateway


@contextmanager
def _run_smg(args: list[str], num_workers: int, log_path: Path) -> Iterator[RunningGateway]:
    smg = shutil.which("smg") or str(Path(sys.executable).parent / "smg")
    port = free_port()
    cmd = [smg, "launch", "--backend", "vllm", "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(free_port()), *args]
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed in finally
    process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    gateway = RunningGateway(process, port, log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"smg exited with {process.returncode}; see {log_path}")
            try:
                healthy = [w for w in gateway.workers() if w.get("is_healthy")]
                if len(healthy) == num_workers:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"smg did not register {num_workers} workers within {START_TIMEOUT_S} s; "
                                   f"see {log_path}")
            time.sleep(0.2)
        yield gateway
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        log_file.close()
