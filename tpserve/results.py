"""What a finished request reports besides its text: usage in tokens, and where its time went.

The client's result objects (:class:`tpserve.client.GenerateResult`, the last
:class:`tpserve.client.StreamChunk` of a stream) carry them; ``tpserve generate --json``
prints them. The server fills them from the request's timeline (coordinator/request_timeline.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tpserve.v1 import generate_pb2 as pb


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # of prompt_tokens, found in the server's prefix cache


@dataclass(frozen=True, slots=True)
class Timings:
    """Where one request's time went on the replica that finished it, in seconds (the server's
    clock, from its receipt of the request): ``queue_time_s + prefill_time_s + decode_time_s``
    is its time on the server, the caller's wall time less the network.

    Attributes:
        queue_time_s: received until first scheduled (validation, grammar, waiting for a slot).
        prefill_time_s: first scheduled until the first token.
        decode_time_s: first token until the last message.
        time_to_first_token_s: received until the first token (0: none came).
        num_preemptions: times the server took its KV cache back and recomputed it.
        cached_prompt_tokens: prompt tokens found in the server's prefix cache.
        replica: which replica served it, ``<served model name>@<pod or host name>``.
    """

    queue_time_s: float
    prefill_time_s: float
    decode_time_s: float
    time_to_first_token_s: float
    num_preemptions: int
    cached_prompt_tokens: int
    replica: str

    @property
    def e2e_time_s(self) -> float:
        """The request's time on the server: queue + prefill + decode."""
        return self.queue_time_s + self.prefill_time_s + self.decode_time_s

    def to_json_dict(self) -> dict:
        """The ``timings`` object of ``tpserve generate --json``."""
        return asdict(self)


def timings_of(message: pb.GenerateResponse | pb.GenerateStreamResponse) -> Timings | None:
    """A response's timings; None when it has none (a message before the last, an older server)."""
    if not message.HasField("timings"):
        return None
    t = message.timings
    return Timings(t.queue_time_s, t.prefill_time_s, t.decode_time_s, t.time_to_first_token_s, t.num_preemptions,
                   t.cached_prompt_tokens, t.replica)

