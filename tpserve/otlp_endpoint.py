"""``--otlp-traces-endpoint``: the collector's address, checked when the configuration is validated.

The OTLP/gRPC exporter (coordinator/tracing.py) takes a URL's host and port (``http://``: plaintext,
``https://``: TLS, any other scheme: TLS too), or else the whole string as a gRPC target. It refuses
nothing: a port past 65535, ``ftp://x:1`` or a bare word started a server that showed it only in the
exporter's retry warnings after the first request. So the forms the exporter reads as a
collector's address are checked here, and anything else is refused at start-up in one line.

No torch here: the coordinator reads this too.
"""

from __future__ import annotations

from urllib.parse import urlsplit

#: The URL schemes the exporter connects with: http (plaintext), https (TLS), grpc (vLLM's examples; TLS
#: unless OTEL_EXPORTER_OTLP_TRACES_INSECURE=true).
SCHEMES = ("http", "https", "grpc")
_FORMS = "give http://HOST:PORT, https://HOST:PORT (TLS), grpc://HOST:PORT or HOST:PORT"


def check_otlp_endpoint(endpoint: str) -> str:
    """``endpoint`` as given, when it is ``SCHEME://HOST:PORT`` with a scheme of :data:`SCHEMES`, or
    ``HOST:PORT``, with a port in 1-65535; the empty string (no tracing, as the flag left out) too.

    Raises:
        ValueError: another scheme, no host, no port or one outside 1-65535, a user name (the exporter
            would dial it as part of the host; headers go in OTEL_EXPORTER_OTLP_HEADERS), or a path
            after a bare ``HOST:PORT`` (dialled as part of the target too).
    """
    if not endpoint:
        return endpoint
    scheme, has_scheme, _ = endpoint.partition("://")
    if has_scheme and scheme.lower() not in SCHEMES:
        raise ValueError(f"{endpoint} is not OTLP over gRPC (scheme {scheme}): {_FORMS}")
    url = urlsplit(endpoint if has_scheme else f"//{endpoint}")
    try:
        port = url.port
    except ValueError:  # urlsplit's "Port out of range 0-65535" or "could not be cast to integer"
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{endpoint} needs a port in 1-65535")
    if not url.hostname or port is None or url.username is not None \
            or (not has_scheme and (url.path or url.query or url.fragment)):
        raise ValueError(f"{endpoint} is not a collector's address: {_FORMS}")
    return endpoint
