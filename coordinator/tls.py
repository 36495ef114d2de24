"""The public port's TLS certificates: checked at start-up, renewed on SIGHUP without a restart.

* Start-up: every certificate of ``--ssl-certfile``'s chain must be valid now (a
  certificate that expired, or is not valid yet, starts a server whose every client
  then fails the handshake); one that expires within :data:`EXPIRY_WARNING_DAYS`
  is logged as a warning. The private key must match the first (leaf) certificate.
  Errors name the file and the dates.
* SIGHUP (``Cluster.reload``): the three files are read and checked again; if they
  pass, new connections get them (gRPC asks :meth:`ServerCertificates.fetch`, its
  certificate configuration fetcher, at each new handshake; connections already open
  keep theirs); if not, the error is logged and the old ones stay.

The certificate files are parsed with ``cryptography`` (a runtime dependency). No torch.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import serialization

log = structlog.get_logger(__name__)

#: A certificate expiring within this many days is warned about at start-up and on reload.
EXPIRY_WARNING_DAYS = 7

Clock = Callable[[], datetime.datetime]


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


@dataclass(frozen=True, slots=True)
class CertificateFiles:
    """What a (re)load read: the PEM bytes and the leaf certificate's expiry (UTC)."""

    chain: bytes
    key: bytes
    roots: bytes | None
    not_valid_after: datetime.datetime


def read_certificate_files(certfile: str, keyfile: str, ca_certs: str | None, now: Clock = _utc_now) -> CertificateFiles:
    """Reads and checks the server's chain, key and client CA bundle; warns of a near expiry.

    Raises:
        OSError: a file cannot be read.
        ValueError: a file is not PEM of the right kind, a certificate is expired or not
            valid yet (naming the file, the certificate's subject and its dates), or the
            key does not match the leaf certificate.
    """
    chain, key = Path(certfile).read_bytes(), Path(keyfile).read_bytes()
    roots = Path(ca_certs).read_bytes() if ca_certs else None
    try:
        certificates = x509.load_pem_x509_certificates(chain)
    except ValueError as exc:
        raise ValueError(f"{certfile} holds no PEM certificate ({exc})") from exc
    at = now()
    for cert in certificates:
        start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
        dates = f"valid from {start:%Y-%m-%d %H:%M:%S} to {end:%Y-%m-%d %H:%M:%S} UTC"
        subject = cert.subject.rfc4514_string()
        if at < start:
            raise ValueError(f"{certfile}: certificate '{subject}' is not valid yet ({dates}; now "
                             f"{at:%Y-%m-%d %H:%M:%S} UTC)")
        if at > end:
            raise ValueError(f"{certfile}: certificate '{subject}' has expired ({dates}; now "
                             f"{at:%Y-%m-%d %H:%M:%S} UTC)")
        if end - at < datetime.timedelta(days=EXPIRY_WARNING_DAYS):
            log.warning("TLS certificate expires soon", file=certfile, subject=subject,
                        not_valid_after=f"{end:%Y-%m-%d %H:%M:%S} UTC",
                        days_left=round((end - at).total_seconds() / 86400, 1))
    try:
        private_key = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{keyfile} holds no unencrypted PEM private key ({exc})") from exc
    if _public_der(private_key.public_key()) != _public_der(certificates[0].public_key()):
        raise ValueError(f"{keyfile} is not the private key of the first certificate in {certfile}")
    if roots is not None:
        try:
            x509.load_pem_x509_certificates(roots)
        except ValueError as exc:
            raise ValueError(f"{ca_certs} holds no PEM certificate ({exc})") from exc
    return CertificateFiles(chain, key, roots, certificates[0].not_valid_after_utc)


def _public_der(public_key) -> bytes:
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


class ServerCertificates:
    """The public port's TLS credentials, renewable while serving.

    Args:
        certfile, keyfile: PEM certificate chain and its private key.
        ca_certs: PEM CA bundle of accepted client certificates (mutual TLS), or None.
        now: the clock (tests pass their own).

    Raises:
        OSError, ValueError: as :func:`read_certificate_files`.
    """

    def __init__(self, certfile: str, keyfile: str, ca_certs: str | None, now: Clock = _utc_now) -> None:
        self._files = (certfile, keyfile, ca_certs)
        self._now = now
        self._lock = threading.Lock()  # gRPC calls fetch from its own threads
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self.current = read_certificate_files(certfile, keyfile, ca_certs, now)
        self._initial = self._configuration(self.current)

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that ask :meth:`fetch` for renewed certificates at each new handshake."""
        return grpc.dynamic_ssl_server_credentials(self._initial, self.fetch,
                                                   require_client_authentication=self._files[2] is not None)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate configuration fetcher: the configuration read by the last :meth:`reload`, once;
        None (keep the current one) otherwise."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def reload(self) -> CertificateFiles:
        """Reads and checks the files again; new handshakes use them from now on.

        Raises:
            OSError, ValueError: as :func:`read_certificate_files`; the current certificates stay.
        """
        files = read_certificate_files(*self._files, now=self._now)
        configuration = self._configuration(files)
        with self._lock:
            self._pending = configuration
            self.current = files
        return files

    @staticmethod
    def _configuration(files: CertificateFiles) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(files.key, files.chain)], root_certificates=files.roots)
