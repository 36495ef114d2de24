"""``/metrics`` over HTTP, always in Prometheus' text format 0.0.4, whatever the scraper asks for.

prometheus_client negotiates the format from the ``Accept`` header. Since 0.23 its OpenMetrics
output to a scraper that names no ``escaping`` (Prometheus 2.x's default, OpenMetrics 1.0.0
first) writes every sample under an escaped name, ``tpserve:saturation`` as
``tpserve_saturation``, while its ``# TYPE`` lines keep the colon (prometheus/client_python#1177,
open): the series the autoscaling rules query (k8s/components/autoscaling-keda,
k8s/prometheus-adapter: ``tpserve:saturation``, ``tpserve:num_requests_waiting``) and vLLM's
``vllm:`` aliases were stored under other names, and prometheus_client's own parser refused
the page. The text format keeps the colons, which are legal in every version's metric names,
and every Prometheus reads it; nothing here uses what OpenMetrics adds (exemplars).
"""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress does not hold the process at exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        """No access log: a scrape every few seconds would fill stderr."""


def start_metrics_server(port: int, host: str, registry: CollectorRegistry) -> int:
    """Serves ``registry`` on ``host:port`` from a daemon thread; returns the bound port (``port`` 0: the
    one the system chose).

    Raises:
        OSError: the address cannot be bound (in use, not this machine's).
    """
    app = make_wsgi_app(registry)

    def text_format(environ: dict, start_response):  # noqa: ANN202 - WSGI's types
        environ.pop("HTTP_ACCEPT", None)  # no Accept header: prometheus_client writes the text format
        return app(environ, start_response)

    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("MetricsServer", (_Server,), {"address_family": family})
    httpd: WSGIServer = make_server(host, port, text_format, server_class, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd.server_port
