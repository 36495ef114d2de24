"""Round-trip time, echo throughput and integrity of a link between two network namespaces, over TCP.

An echo server runs in one namespace, a client in the other: ``pings`` round trips of a
64-byte message (each timed), then ``nbytes`` of seeded random bytes sent while a
second thread reads the echo back (timed from the first byte sent to the last byte
received, so both directions carry ``nbytes``) and compares it with what was sent.

    python tests/cluster/link_probe.py serve HOST PORT            # prints "listening"
    python tests/cluster/link_probe.py measure HOST PORT [--pings N] [--bytes N]   # prints JSON

Standard library only, so it runs under any ``python`` in any namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

CHUNK = 1 << 16


def serve(host: str, port: int) -> None:
    """Echoes every connection's bytes back until killed."""
    listener = socket.create_server((host, port))
    print("listening", flush=True)

    def echo(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(CHUNK):
                conn.sendall(data)

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=echo, args=(conn,), daemon=True).start()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        data = sock.recv(min(left, CHUNK))
        if not data:
            raise ConnectionError(f"the echo closed with {left} of {n} bytes missing")
        parts.append(data)
        left -= len(data)
    return b"".join(parts)


def measure(host: str, port: int, pings: int, nbytes: int) -> dict:
    """Returns ``rtt_ms`` (one per ping), ``echo_mb_per_s`` (MB = 1e6 bytes, each way) and ``intact``."""
    with socket.create_connection((host, port), timeout=60) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtt_ms = []
        for i in range(pings):
            message = i.to_bytes(64, "little")
            started = time.perf_counter()
            sock.sendall(message)
            assert _recv_exactly(sock, 64) == message
            rtt_ms.append((time.perf_counter() - started) * 1000)
        payload = random.Random(0).randbytes(nbytes)
        received: list[bytes] = []
        reader = threading.Thread(target=lambda: received.append(_recv_exactly(sock, nbytes)))
        started = time.perf_counter()
        reader.start()
        sock.sendall(payload)
        reader.join()
        seconds = time.perf_counter() - started
    return {"rtt_ms": rtt_ms, "echo_bytes": nbytes, "echo_seconds": seconds,
            "echo_mb_per_s": nbytes / seconds / 1e6, "intact": bool(received) and received[0] == payload}


def probe(server_namespace: str, server_addr: str, client_namespace: str, port: int = 47001, pings: int = 20,
          nbytes: int = 4 << 20) -> dict:
    """Runs the echo server in ``server_namespace`` (on ``server_addr``) and the client in ``client_namespace``.

    Raises:
        subprocess.CalledProcessError / RuntimeError: the client or the server failed, with its output.
    """
    script = os.path.abspath(__file__)
    server = subprocess.Popen(["ip", "netns", "exec", server_namespace, sys.executable, script, "serve", server_addr,
                               str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != b"listening":
            server.kill()
            raise RuntimeError(f"the echo server did not start: {server.communicate()[1].decode()[-2000:]}")
        out = subprocess.run(["ip", "netns", "exec", client_namespace, sys.executable, script, "measure", server_addr,
                              str(port), "--pings", str(pings), "--bytes", str(nbytes)],
                             check=True, capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout)
    finally:
        server.kill()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("serve", "measure"))
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--pings", type=int, default=20)
    parser.add_argument("--bytes", type=int, default=4 << 20)
    args = parser.parse_args(argv)
    if args.mode == "serve":
        serve(args.host, args.port)
    else:
        print(json.dumps(measure(args.host, args.port, args.pings, args.bytes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
