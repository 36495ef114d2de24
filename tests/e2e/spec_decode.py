"""Reading a server's speculative-decoding counters, shared by the spec-decode serving tests."""

from __future__ import annotations

import re
import urllib.request


def spec_counters(cluster) -> dict[str, float]:
    """The tpserve:spec_decode_* samples, labelled ones as name{position="i"}."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5).read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^(tpserve:spec_decode_\S+_total(?:\{[^}]*\})?) (\S+)$", body, re.MULTILINE)}
