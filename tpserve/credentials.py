"""How a client proves itself to a tpserve server: TLS files and an API key (:class:`Credentials`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from tpserve.grpc_metadata import metadata_interceptors

@dataclass(frozen=True)
class Credentials:
    """How a client proves itself to a server started with TLS, mutual TLS or API keys.

    Attributes:
        ssl_ca_certs: PEM CA bundle that signed the server's certificate; setting any
            ``ssl_*`` field makes the channel TLS (None here: the system's roots).
        ssl_certfile, ssl_keyfile: PEM client certificate and key (mutual TLS): both or neither.
        api_key: sent as ``authorization: Bearer <api_key>`` on every Generation call.

    Raises:
        ValueError: a client certificate without its key or a key without its certificate (grpc's C core
            aborted the whole process on the first call: SIGABRT, which no ``except`` catches).
    """

    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    api_key: str | None = None

    def __post_init__(self) -> None:
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            given, missing = ("ssl_certfile", "ssl_keyfile") if self.ssl_certfile else ("ssl_keyfile", "ssl_certfile")
            raise ValueError(f"{given} needs {missing}: mutual TLS takes the client certificate and its key together")

    @property
    def tls(self) -> bool:
        return any((self.ssl_ca_certs, self.ssl_certfile, self.ssl_keyfile))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS credentials from the PEM files.

        Raises:
            OSError: a file cannot be read.
        """
        def read(path: str | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return grpc.ssl_channel_credentials(root_certificates=read(self.ssl_ca_certs),
                                            private_key=read(self.ssl_keyfile),
                                            certificate_chain=read(self.ssl_certfile))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the bearer key, if any."""
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def aio_channel(self, target: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        """An asyncio channel to ``target`` whose every call carries these credentials
        (for stubs used directly, such as the load generator's)."""
        interceptors = metadata_interceptors(self.metadata) if self.metadata else None
        if self.tls:
            return grpc.aio.secure_channel(target, self.channel_credentials(), options=list(options),
                                           interceptors=interceptors)
        return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)

    @staticmethod
    def add_flags(parser) -> None:
        """The client side of ``tpserve serve``'s --ssl-* and --api-key flags, on an argparse parser."""
        group = parser.add_argument_group("credentials")
        group.add_argument("--ssl-ca-certs", help="PEM CA bundle that signed the server's certificate (TLS)")
        group.add_argument("--ssl-certfile", help="PEM client certificate (mutual TLS)")
        group.add_argument("--ssl-keyfile", help="PEM key of --ssl-certfile")
        group.add_argument("--api-key", default=os.environ.get("TPSERVE_API_KEY"),
                           help="bearer key for a server started with --api-key (default: $TPSERVE_API_KEY)")

    @classmethod
    def from_flags(cls, args) -> Credentials:
        """From the attributes :meth:`add_flags` defines on an argparse namespace.

        Raises:
            ValueError: ``--ssl-certfile`` without ``--ssl-keyfile`` or the other way round, naming the flags.
        """
        if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
            given, missing = ("--ssl-certfile", "--ssl-keyfile") if args.ssl_certfile else \
                ("--ssl-keyfile", "--ssl-certfile")
            raise ValueError(f"{given} needs {missing}: mutual TLS takes the client certificate and its key together")
        return cls(ssl_ca_certs=args.ssl_ca_certs, ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                   api_key=args.api_key)
