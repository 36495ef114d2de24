"""The client's gRPC service config: load balancing, and gRPC's own retry policy (gRFC A6).

A tpserve client channel retries a call that failed with ``UNAVAILABLE`` (a replica killed or
restarting, a server draining, a connection reset) or ``RESOURCE_EXHAUSTED`` (a full queue)
by gRPC's retry policy, inside the gRPC library: no code of ours re-sends it.

- Which calls: every method of ``tpserve.v1.Generation``; unary calls whole, server-streaming
  calls until they are committed, which is when the first response arrives (the server sends
  its headers with the first message). Health checks are not retried (``wait_ready`` polls).
- How often: at most ``max_attempts`` attempts (gRPC caps it at 5), attempt n+1 after about
  min(initial_backoff_s * backoff_multiplier**(n-1), max_backoff_s) seconds (gRPC jitters it by
  up to 20%). The defaults are Envoy's retry backoff (25 ms, at most 250 ms): a call whose replica
  died is sent again to another one at once (the load balancer picks only connected replicas), and
  a target with no server at all is reported within about 0.4 s (0.025 + 0.05 + 0.1 + 0.2 s).
- Server pushback: when the server's status carries ``grpc-retry-pushback-ms`` trailing
  metadata, gRPC waits exactly that long instead (tpserve sends it with a full queue's
  ``RESOURCE_EXHAUSTED``: coordinator/pushback.py); a negative value means "do not retry"
  (sent with the ``RESOURCE_EXHAUSTED`` that retrying cannot cure: a request larger than the
  KV cache). ``RESOURCE_EXHAUSTED`` is retryable for that reason: a retry is paced by the
  server, as vLLM's and TGI's clients back off on 429.
- Throttling: the channel keeps a token bucket per target (``retryThrottling``): each failed
  attempt takes a token, each success returns ``throttle_token_ratio``; below half of
  ``throttle_max_tokens`` gRPC stops retrying, so a fleet that is down or overloaded as a whole
  gets its errors at once, not five times the load.

The stream mover (tpserve/stream_move.py) handles what gRPC cannot: a stream that breaks after
messages arrived (committed, so gRPC never retries it) continues on another replica from the
tokens delivered, and ``INTERNAL`` from a lost worker group. The two nest, never race: each move
is a new call with its own gRPC attempts, and no attempt gRPC retries has delivered a message.

Keepalive (:class:`Keepalive`): a replica that goes silent without closing its connection (its
process frozen, its host or link gone) sends no FIN or RST, so without pings a call on it waits
forever and the stream mover never hears of the loss. The client's channels ping after
``time_s`` (10 s) without a frame from the server and close the connection when a ping goes
unanswered for ``timeout_s`` (10 s): calls on it fail with ``UNAVAILABLE`` within about
``time_s + timeout_s`` (20 s) of the server's last frame, and the stream mover takes over. The
tpserve server accepts pings at any rate down to one a second, with or without calls
(docs/design/faults.md, "Public keepalive").
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal, get_args

import grpc

LoadBalancingPolicy = Literal["round_robin", "pick_first"]
#: The service whose methods the retry policy covers (proto/tpserve/v1/generate.proto).
GENERATION_SERVICE = "tpserve.v1.Generation"


#: gRPC's range of a retry backoff, seconds: whole milliseconds (0.0005 s is "must be greater than 0"), up to
#: protobuf's longest Duration.
MIN_BACKOFF_S, MAX_BACKOFF_S = 0.001, 315_576_000_000.0
#: The least retry token ratio: gRPC keeps thousandths of a token (0.0005 is "must be greater than 0").
MIN_TOKEN_RATIO = 0.001
_STATUS_NAMES = tuple(code.name for code in grpc.StatusCode)


@dataclass(frozen=True)
class RetryPolicy:
    """gRPC's retry policy for a client's calls (see the module docstring).

    Attributes:
        max_attempts: attempts per call, the first included (1: no retries; gRPC caps it at 5).
        initial_backoff_s, max_backoff_s, backoff_multiplier: the wait before attempt n+1 is about
            ``min(initial_backoff_s * backoff_multiplier**(n-1), max_backoff_s)`` seconds. Backoffs are in
            [0.001, 315576000000] s (gRPC counts whole milliseconds), ``max_backoff_s`` at least
            ``initial_backoff_s``; the multiplier is > 0.
        retryable_status_codes: the statuses retried, at least one (``grpc.StatusCode`` names).
        throttle_max_tokens, throttle_token_ratio: the channel's retry token bucket: a whole number of tokens
            in [1, 2**32 - 1], and a ratio of at least 0.001 (gRPC keeps thousandths of a token).

    Raises:
        ValueError: a field outside gRPC's range (gRFC A6's service config), naming it and the range. gRPC
            itself takes such a channel and fails each of its calls with INVALID_ARGUMENT, as if the server
            had refused the request.
    """

    max_attempts: int = 5
    initial_backoff_s: float = 0.025
    max_backoff_s: float = 0.25
    backoff_multiplier: float = 2.0
    retryable_status_codes: tuple[str, ...] = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")
    throttle_max_tokens: int = 10
    throttle_token_ratio: float = 0.1

    def __post_init__(self) -> None:
        _check_number("max_attempts", self.max_attempts, 1, math.inf, integer=True)
        _check_number("initial_backoff_s", self.initial_backoff_s, MIN_BACKOFF_S, MAX_BACKOFF_S)
        _check_number("max_backoff_s", self.max_backoff_s, MIN_BACKOFF_S, MAX_BACKOFF_S)
        if self.max_backoff_s < self.initial_backoff_s:  # gRPC takes it, and waits max_backoff_s every time
            raise ValueError(f"RetryPolicy.max_backoff_s must be >= initial_backoff_s ({self.initial_backoff_s!r}), "
                             f"got {self.max_backoff_s!r}")
        _check_number("backoff_multiplier", self.backoff_multiplier, 0, math.inf, open_low=True)
        _check_number("throttle_max_tokens", self.throttle_max_tokens, 1, 2**32 - 1, integer=True)
        _check_number("throttle_token_ratio", self.throttle_token_ratio, MIN_TOKEN_RATIO, math.inf)
        codes = self.retryable_status_codes
        if isinstance(codes, str) or not codes or any(code not in _STATUS_NAMES for code in codes):
            raise ValueError(f"RetryPolicy.retryable_status_codes must be a non-empty tuple of grpc.StatusCode "
                             f"names ({', '.join(_STATUS_NAMES)}), got {codes!r}")


def _check_number(name: str, value: object, low: float, high: float, *, integer: bool = False,
                  open_low: bool = False) -> None:
    """Checks ``RetryPolicy.<name>``: a number (an ``int`` where ``integer``) in [low, high] ((low, high] where
    ``open_low``; inf and NaN are never in range: gRPC's JSON has no such number).

    Raises:
        ValueError: naming the field, the range and the value.
    """
    if isinstance(value, int if integer else (int, float)) and not isinstance(value, bool):
        number = float(value)
        if math.isfinite(number) and (low < number if open_low else low <= number) and number <= high:
            return
    kind = "an integer" if integer else "a number"
    bound = f"> {low:.15g}" if open_low else f">= {low:.15g}"
    upper = f" and <= {high:.15g}" if math.isfinite(high) else ""
    raise ValueError(f"RetryPolicy.{name} must be {kind} {bound}{upper}, got {value!r}")


@dataclass(frozen=True)
class Keepalive:
    """HTTP/2 keepalive pings of a client's channels (see the module docstring).

    Attributes:
        time_s: seconds without a frame from the server before the client pings it
            (``grpc.keepalive_time_ms``); at least 1 (the tpserve server refuses faster pings).
        timeout_s: seconds a ping may go unanswered before the connection is closed and its calls
            fail with ``UNAVAILABLE`` (``grpc.keepalive_timeout_ms``); a silent server is noticed within
            about ``time_s + timeout_s`` seconds of its last frame.
        enabled: False sends no pings (a silent server then holds a call until its deadline).
    """

    time_s: float = 10.0
    timeout_s: float = 10.0
    enabled: bool = True


def keepalive_options(keepalive: Keepalive = Keepalive()) -> list[tuple[str, object]]:
    """gRPC channel options for ``keepalive``: none when it is off.

    Raises:
        ValueError: ``time_s`` below 1 or ``timeout_s`` not positive.
    """
    if not keepalive.enabled:
        return []
    if keepalive.time_s < 1:
        # The server's grpc.http2.min_ping_interval_without_data_ms is 1 s: faster pings would earn GOAWAY.
        raise ValueError(f"Keepalive.time_s must be at least 1 s, got {keepalive.time_s}")
    if keepalive.timeout_s <= 0:
        raise ValueError(f"Keepalive.timeout_s must be positive, got {keepalive.timeout_s}")
    return [("grpc.keepalive_time_ms", round(keepalive.time_s * 1000)),
            ("grpc.keepalive_timeout_ms", round(keepalive.timeout_s * 1000)),
            # Every ping gets the same time to be answered: gRPC sends a BDP ping with a call's first data and
            # allows one ping in flight, so a server frozen after that ping was answered by no keepalive ping,
            # only by the BDP ping's own timeout (60 s by default; grpcio 1.85).
            ("grpc.http2.ping_timeout_ms", round(keepalive.timeout_s * 1000)),
            # A connection with no call open is pinged too, so that the next call does not land on a dead one.
            ("grpc.keepalive_permit_without_calls", 1),
            # gRPC's client stops pinging after 2 pings without sending data; a server stream sends the
            # server's data only, so without 0 (no limit) a frozen server would go unnoticed after 2 pings.
            ("grpc.http2.max_pings_without_data", 0)]


def service_config(load_balancing_policy: LoadBalancingPolicy = "round_robin",
                   retry_policy: RetryPolicy = RetryPolicy()) -> dict:
    """The service config (gRPC's JSON form, as a dict) of a client channel (``retry_policy`` was checked
    when it was made).

    Raises:
        ValueError: ``load_balancing_policy`` is not one of :data:`LoadBalancingPolicy`'s.
    """
    if load_balancing_policy not in get_args(LoadBalancingPolicy):
        raise ValueError(f"load_balancing_policy must be one of {', '.join(get_args(LoadBalancingPolicy))}, "
                         f"got {load_balancing_policy!r}")
    config: dict = {"loadBalancingConfig": [{load_balancing_policy: {}}]}
    if retry_policy.max_attempts == 1:
        return config  # gRPC refuses a retryPolicy of fewer than 2 attempts: no policy is none
    config["methodConfig"] = [{
        "name": [{"service": GENERATION_SERVICE}],
        "retryPolicy": {
            "maxAttempts": retry_policy.max_attempts,
            "initialBackoff": _duration(retry_policy.initial_backoff_s),
            "maxBackoff": _duration(retry_policy.max_backoff_s),
            "backoffMultiplier": retry_policy.backoff_multiplier,
            "retryableStatusCodes": list(retry_policy.retryable_status_codes),
        },
    }]
    config["retryThrottling"] = {"maxTokens": retry_policy.throttle_max_tokens,
                                 "tokenRatio": retry_policy.throttle_token_ratio}
    return config


def _duration(seconds: float) -> str:
    """``seconds`` as protobuf's JSON Duration, which gRPC parses: at most 9 decimals and no exponent
    (``str(1e-05)`` would be "1e-05")."""
    return f"{seconds:.9f}".rstrip("0").rstrip(".") + "s"


def channel_options(load_balancing_policy: LoadBalancingPolicy = "round_robin",
                    retry_policy: RetryPolicy = RetryPolicy(),
                    keepalive: Keepalive = Keepalive()) -> list[tuple[str, object]]:
    """gRPC channel options: the service config above, retries on (``grpc.enable_retries``,
    gRPC's default since 1.40, set so that an environment cannot turn them off unseen), and
    :func:`keepalive_options`.

    Raises:
        ValueError: as :func:`service_config` and :func:`keepalive_options`.
    """
    return [("grpc.service_config", json.dumps(service_config(load_balancing_policy, retry_policy))),
            ("grpc.enable_retries", 1), *keepalive_options(keepalive)]
