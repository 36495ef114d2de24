"""The public port under mutual TLS and API keys, with certificates made in the test (``cryptography``),
and logs that never carry what users send or receive.

One server (the embedded model, tp 1) requires a client certificate signed by the
test CA and an API key. Refused: a plaintext client, a TLS client without a
client certificate, a client with a certificate from another CA (all three fail
the handshake: UNAVAILABLE), and a client without the key or with a wrong one
(UNAUTHENTICATED). The health service answers without a key, for probes.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.cluster import serve
from tpserve.client import AsyncClient, Client, Credentials

pytestmark = pytest.mark.e2e

API_KEY = "tpserve-test-key-0123456789"


def _write_cert(directory: Path, name: str, common_name: str, issuer: tuple | None, *, ca: bool,
                valid_days: tuple[float, float] = (-5 / 1440, 1)) -> tuple:
    """A key and certificate (self-signed when ``issuer`` is None), written as NAME.key / NAME.pem, valid from
    ``valid_days[0]`` to ``valid_days[1]`` days from now."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    issuer_name, issuer_key = (subject, key) if issuer is None else (issuer[1].subject, issuer[0])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now + datetime.timedelta(days=valid_days[0]))
               .not_valid_after(now + datetime.timedelta(days=valid_days[1]))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    (directory / f"{name}.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    ca = _write_cert(d, "ca", "tpserve test CA", None, ca=True)
    _write_cert(d, "server", "tpserve server", ca, ca=False)
    _write_cert(d, "client", "tpserve client", ca, ca=False)
    other_ca = _write_cert(d, "other-ca", "some other CA", None, ca=True)
    _write_cert(d, "stranger", "stranger", other_ca, ca=False)
    return d


def _creds(pki: Path, *, client: str | None = "client", api_key: str | None = API_KEY) -> Credentials:
    return Credentials(ssl_ca_certs=str(pki / "ca.pem"),
                       ssl_certfile=None if client is None else str(pki / f"{client}.pem"),
                       ssl_keyfile=None if client is None else str(pki / f"{client}.key"), api_key=api_key)


@pytest.fixture(scope="module")
def secured(pki: Path):
    flags = ("--ssl-certfile", str(pki / "server.pem"), "--ssl-keyfile", str(pki / "server.key"),
             "--ssl-ca-certs", str(pki / "ca.pem"), "--api-key", API_KEY)
    with serve(None, 1, *flags, credentials=_creds(pki)) as cluster:
        yield cluster


def _code(target: str, credentials: Credentials) -> grpc.StatusCode:
    with Client(target, credentials=credentials) as client:
        try:
            client.generate("Once upon a time", max_tokens=4, temperature=0, timeout_s=20)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_the_right_certificate_and_key_are_served(secured) -> None:
    result = secured.client.generate("Once upon a time", max_tokens=8, temperature=0)
    assert result.usage.completion_tokens == 8 and result.text


def test_callers_without_the_right_credentials_are_refused(secured, pki: Path) -> None:
    target = secured.target
    assert _code(target, Credentials(api_key=API_KEY)) == grpc.StatusCode.UNAVAILABLE  # plaintext
    assert _code(target, _creds(pki, client=None)) == grpc.StatusCode.UNAVAILABLE  # no client certificate
    assert _code(target, _creds(pki, client="stranger")) == grpc.StatusCode.UNAVAILABLE  # another CA's
    assert _code(target, _creds(pki, api_key=None)) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(target, _creds(pki, api_key="wrong-key")) == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info, Client(target, credentials=_creds(pki, api_key=None)) as client:
        list(client.generate_stream("Once upon a time", max_tokens=4))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer" in info.value.details()


def test_health_answers_probes_without_a_key(secured, pki: Path) -> None:
    creds = _creds(pki, api_key=None)
    channel = grpc.secure_channel(secured.target, creds.channel_credentials())
    try:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    finally:
        channel.close()
    assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_async_client_and_cli_take_the_credentials(secured, pki: Path) -> None:
    import asyncio

    async def run() -> str:
        async with AsyncClient(secured.target, credentials=_creds(pki)) as client:
            return "".join([c.text async for c in client.generate_stream("Once upon a time", max_tokens=6,
                                                                          temperature=0)])

    streamed = asyncio.run(run())
    expected = secured.client.generate("Once upon a time", max_tokens=6, temperature=0).text
    assert streamed == expected
    cli = [sys.executable, "-m", "launch.cli", "generate", "--target", secured.target, "--max-tokens", "6",
           "--temperature", "0", "--ssl-ca-certs", str(pki / "ca.pem"), "--ssl-certfile", str(pki / "client.pem"),
           "--ssl-keyfile", str(pki / "client.key")]
    env = {k: v for k, v in os.environ.items() if k != "TPSERVE_API_KEY"}
    ok = subprocess.run([*cli, "Once upon a time"], capture_output=True, text=True, timeout=60,
                        env={**env, "TPSERVE_API_KEY": API_KEY})
    assert ok.returncode == 0 and ok.stdout.rstrip("\n") == expected, ok.stderr
    refused = subprocess.run([*cli, "Once upon a time"], capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 1 and refused.stderr.startswith("UNAUTHENTICATED"), refused.stderr


def test_bad_security_flags_are_refused_at_start_up(tmp_path: Path) -> None:
    from tpserve.config import ClusterConfig

    with pytest.raises(ValueError, match="go together"):
        ClusterConfig.load_from(overrides={"server": {"ssl_certfile": "a.pem"}})
    with pytest.raises(ValueError, match="needs --ssl-certfile"):
        ClusterConfig.load_from(overrides={"server": {"ssl_ca_certs": "ca.pem"}})
    from coordinator.auth import read_api_keys

    keys = tmp_path / "keys"
    keys.write_text("# team keys\nalpha\n\n beta \n")
    assert read_api_keys("gamma", str(keys)) == ["gamma", "alpha", "beta"]
    keys.write_text("# none\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_api_keys(None, str(keys))
    with pytest.raises(ValueError, match="whitespace"):
        read_api_keys("two words", None)


CANARY = "zebra-canary-7f3a"


def test_no_prompt_or_generated_text_in_the_logs(tmp_path: Path) -> None:
    """A planted string in prompts, stop strings and bad requests never reaches the log (JSON, default level)."""
    log_path = tmp_path / "server.log"
    with serve(None, 2, "--log-format", "json", log_path=log_path) as cluster:
        client = cluster.client
        prompt = f"Once upon a time {CANARY}"
        result = client.generate(prompt, max_tokens=12, temperature=0, stop=[CANARY])
        generated = result.text.strip()
        stream = client.generate_stream(prompt, max_tokens=64, temperature=0.9, seed=3)
        next(stream)
        stream.cancel()  # an aborted request is logged (by id)
        for bad in (dict(max_tokens=-1), dict(temperature=float("nan")), dict(stop=[CANARY * 200])):
            with pytest.raises(grpc.RpcError):
                client.generate(prompt, **bad)
        with pytest.raises(grpc.RpcError):
            client.generate([10**9, 5], max_tokens=4)  # token ids out of range
    log = log_path.read_text(errors="replace")
    assert "request aborted" in log  # the log was captured
    assert CANARY not in log
    assert len(generated) < 8 or generated not in log  # the completion's text


def test_the_load_generator_takes_the_credentials(secured, pki: Path, tmp_path: Path) -> None:
    import json

    result_file = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "launch.cli", "bench", "--target", secured.target, "--num-prompts", "4",
           "--input-len", "16", "--output-len", "4", "--request-rate", "inf", "--result-file", str(result_file),
           "--ssl-ca-certs", str(pki / "ca.pem"), "--ssl-certfile", str(pki / "client.pem"),
           "--ssl-keyfile", str(pki / "client.key"), "--api-key", API_KEY]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    records = json.loads(result_file.read_text())["runs"][0]["requests"]
    assert len(records) == 4 and all(r["status"] == "OK" for r in records)


@dataclasses.dataclass(frozen=True)
class _LowerCaseBearer(Credentials):
    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"bearer {self.api_key}"),)  # RFC 6750 allows any case


def _wait_for_line(log_path: Path, text: str, after: int = 0, timeout_s: float = 15.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = log_path.read_text(errors="replace")
        if text in log[after:]:
            return log
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} in the log: {log_path.read_text(errors='replace')[-3000:]}")


def test_sighup_reloads_certificates_and_keys_without_a_restart(tmp_path: Path) -> None:
    """Issue 20, item 10: SIGHUP killed the server at once (no drain), and keys and certificates were read once.
    Now an in-flight stream finishes, new connections get the new certificate (signed by another CA here, so
    the old one cannot pass) and the new key, a file that fails its checks leaves the old ones in place,
    and the ``bearer`` scheme is accepted in lower case."""
    ca_one = _write_cert(tmp_path, "ca-one", "CA one", None, ca=True)
    ca_two = _write_cert(tmp_path, "ca-two", "CA two", None, ca=True)
    _write_cert(tmp_path, "server", "server one", ca_one, ca=False)
    keys = tmp_path / "keys"
    keys.write_text("key-one\n")
    log_path = tmp_path / "server.log"
    flags = ("--ssl-certfile", str(tmp_path / "server.pem"), "--ssl-keyfile", str(tmp_path / "server.key"),
             "--api-key-file", str(keys))
    one = Credentials(ssl_ca_certs=str(tmp_path / "ca-one.pem"), api_key="key-one")
    with serve(None, 1, *flags, credentials=one, log_path=log_path) as cluster:
        stream = cluster.client.generate_stream("Once upon a time", max_tokens=60, temperature=0, ignore_eos=True,
                                                timeout_s=60)
        token_ids = list(next(stream).token_ids)
        _write_cert(tmp_path, "server", "server two", ca_two, ca=False)
        keys.write_text("key-two\n")
        cluster.process.send_signal(signal.SIGHUP)
        token_ids += [t for chunk in stream for t in chunk.token_ids]
        assert len(token_ids) == 60  # the stream in flight finished
        log = _wait_for_line(log_path, "TLS certificates reloaded")
        assert "API keys reloaded" in log and cluster.process.poll() is None
        two = str(tmp_path / "ca-two.pem")
        assert _code(cluster.target, _LowerCaseBearer(ssl_ca_certs=two, api_key="key-two")) == grpc.StatusCode.OK
        assert _code(cluster.target, Credentials(ssl_ca_certs=two, api_key="key-one")) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert _code(cluster.target, Credentials(ssl_ca_certs=str(tmp_path / "ca-one.pem"), api_key="key-two")) == \
            grpc.StatusCode.UNAVAILABLE  # the old certificate is no longer served
        # A broken rotation (an empty key file, an expired certificate) keeps what works.
        keys.write_text("# emptied by mistake\n")
        _write_cert(tmp_path, "server", "server three", ca_one, ca=False, valid_days=(-3, -1))
        cluster.process.send_signal(signal.SIGHUP)
        log = _wait_for_line(log_path, "TLS certificates not reloaded", after=len(log))
        assert "API keys not reloaded" in log and "has expired" in log
        assert _code(cluster.target, Credentials(ssl_ca_certs=two, api_key="key-two")) == grpc.StatusCode.OK
        assert cluster.process.poll() is None


def test_an_expired_certificate_is_refused_at_start_up(tmp_path: Path) -> None:
    """Before, it started and every client then failed the handshake; now one line names the file and dates."""
    _write_cert(tmp_path, "server", "server", None, ca=False, valid_days=(-30, -2))
    cmd = [sys.executable, "-m", "launch.cli", "serve", "--port", "0", "--ssl-certfile", str(tmp_path / "server.pem"),
           "--ssl-keyfile", str(tmp_path / "server.key")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)  # before: it served, never exiting
    assert done.returncode == 1
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("tpserve serve:")]
    assert f"{tmp_path / 'server.pem'}: certificate 'CN=server' has expired (valid from" in line
    assert "Traceback" not in done.stderr
