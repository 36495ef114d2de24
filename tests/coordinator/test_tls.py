"""Certificates and API keys in operation (docs/design/security.md, "Keys and certificates are renewable"), without a
server: start-up checks of the
certificate files, their renewal on reload, and the bearer scheme in any case.

Certificates are made here with ``cryptography``; the clock is passed in, so dates are exact."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from structlog.testing import capture_logs

from coordinator.auth import ApiKeyInterceptor, Role
from coordinator.tls import ServerCertificates, read_certificate_files

NOW = datetime.datetime(2026, 6, 1, 12, 0, tzinfo=datetime.timezone.utc)
DAY = datetime.timedelta(days=1)


def write_certificate(directory: Path, name: str, not_before: datetime.datetime, not_after: datetime.datetime,
                      key: ec.EllipticCurvePrivateKey | None = None) -> tuple[Path, Path]:
    """A self-signed certificate NAME.pem and its key NAME.key, valid from ``not_before`` to ``not_after``."""
    key = key or ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(not_before).not_valid_after(not_after)
            .sign(key, hashes.SHA256()))
    (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return directory / f"{name}.pem", directory / f"{name}.key"


def test_an_expired_or_not_yet_valid_certificate_is_refused_naming_the_file_and_dates(tmp_path: Path) -> None:
    cert, key = write_certificate(tmp_path, "old", NOW - 30 * DAY, NOW - DAY)
    with pytest.raises(ValueError, match=rf"{cert}: certificate 'CN=old' has expired \(valid from 2026-05-02 12:00:00 "
                                         r"to 2026-05-31 12:00:00 UTC; now 2026-06-01 12:00:00 UTC\)"):
        read_certificate_files(str(cert), str(key), None, now=lambda: NOW)
    cert, key = write_certificate(tmp_path, "future", NOW + DAY, NOW + 90 * DAY)
    with pytest.raises(ValueError, match=rf"{cert}: certificate 'CN=future' is not valid yet \(valid from "
                                         r"2026-06-02 12:00:00 to 2026-08-30 12:00:00 UTC"):
        ServerCertificates(str(cert), str(key), None, now=lambda: NOW)


def test_a_certificate_expiring_within_seven_days_is_warned_about(tmp_path: Path) -> None:
    soon, soon_key = write_certificate(tmp_path, "soon", NOW - DAY, NOW + 3 * DAY)
    later, later_key = write_certificate(tmp_path, "later", NOW - DAY, NOW + 30 * DAY)
    with capture_logs() as logs:
        read_certificate_files(str(later), str(later_key), None, now=lambda: NOW)
        files = read_certificate_files(str(soon), str(soon_key), None, now=lambda: NOW)
    assert files.not_valid_after == NOW + 3 * DAY
    assert [(e["event"], e["log_level"], e["file"], e["days_left"]) for e in logs] == [
        ("TLS certificate expires soon", "warning", str(soon), 3.0)]


def test_a_key_of_another_certificate_is_refused(tmp_path: Path) -> None:
    cert, _ = write_certificate(tmp_path, "a", NOW - DAY, NOW + 90 * DAY)
    _, other_key = write_certificate(tmp_path, "b", NOW - DAY, NOW + 90 * DAY)
    with pytest.raises(ValueError, match=rf"{other_key} is not the private key of the first certificate in {cert}"):
        read_certificate_files(str(cert), str(other_key), None, now=lambda: NOW)


def test_reload_hands_gRPC_the_new_files_once_and_keeps_the_old_on_error(tmp_path: Path) -> None:
    cert, key = write_certificate(tmp_path, "server", NOW - DAY, NOW + 30 * DAY)
    certificates = ServerCertificates(str(cert), str(key), None, now=lambda: NOW)
    assert certificates.credentials() is not None
    assert certificates.fetch() is None  # nothing new: gRPC keeps what it has
    write_certificate(tmp_path, "server", NOW - DAY, NOW + 60 * DAY)  # renewed in place
    assert certificates.reload().not_valid_after == NOW + 60 * DAY
    assert certificates.fetch() is not None and certificates.fetch() is None
    write_certificate(tmp_path, "server", NOW - 9 * DAY, NOW - DAY)  # a wrong file put in place
    with pytest.raises(ValueError, match="has expired"):
        certificates.reload()
    assert certificates.fetch() is None and certificates.current.not_valid_after == NOW + 60 * DAY


@pytest.mark.parametrize("value, accepted", [
    ("Bearer k1", True), ("bearer k1", True), ("BEARER k2", True), ("bEaReR  k1", True),  # RFC 6750: any case
    ("Bearer k3", False), ("Basic k1", False), ("Bearerk1", False), ("k1", False), ("Bearer k1 k2", False),
    ("Bearer ", False)])
def test_the_bearer_scheme_is_case_insensitive(value: str, accepted: bool) -> None:
    interceptor = ApiKeyInterceptor(["k1", "k2"])
    assert (interceptor.role([("authorization", value)]) is Role.TENANT) is accepted
    assert (interceptor.role([("authorization", value.encode())]) is Role.TENANT) is accepted


def test_set_keys_replaces_the_keys() -> None:
    interceptor = ApiKeyInterceptor(["old"])
    interceptor.set_keys(["new"], ["boss"])
    assert interceptor.role([("authorization", "Bearer new")]) is Role.TENANT
    assert interceptor.role([("authorization", "Bearer boss")]) is Role.OPERATOR
    assert interceptor.role([("authorization", "Bearer old")]) is None
    with pytest.raises(ValueError, match="at least one key"):
        interceptor.set_keys([])


def test_a_key_in_both_lists_is_an_operators() -> None:
    interceptor = ApiKeyInterceptor(["shared", "tenant"], ["shared"])
    assert interceptor.role([("authorization", "Bearer shared")]) is Role.OPERATOR
    assert interceptor.role([("authorization", "Bearer tenant")]) is Role.TENANT
