"""``kv_transfer_params_json``: the NIXL connector's hand-off fields, read and written at the edge.

What ``smg --pd-disaggregation`` sends and expects (smg 1.13, verified against two replicas;
docs/design/cluster.md, "Prefill/decode disaggregation"):

- to the prefill replica: ``{"do_remote_decode": true, "do_remote_prefill": false}``, with
  ``max_tokens`` 1 and ``ignore_eos``, not streamed; its GenerateComplete's
  ``kv_transfer_params_json`` is forwarded verbatim to the decode replica;
- to the decode replica: the same request (its own sampling parameters, the same request id)
  with that JSON: ``do_remote_prefill`` true, ``remote_engine_id``, ``remote_block_ids``,
  ``remote_host``, ``remote_port`` (vLLM's names), plus ours: ``remote_request_id`` (the hold's
  unguessable id), ``tp_size``, ``block_size`` and ``kv_cache_dtype`` (each must equal the decode
  replica's; ``kv_cache_dtype`` is ``--kv-cache-dtype``: an 8-bit cache's blocks are its codes and scales).

No torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from coordinator.errors import InvalidArgumentError

FIELD = "kv_transfer_params_json"
#: Most block ids a hand-off may name (a 1M-token prompt of 16-token blocks).
MAX_BLOCKS = 65536


@dataclass(frozen=True)
class KVTransferParams:
    """A request's hand-off fields (vLLM's NIXL connector names).

    Attributes:
        do_remote_decode: this (prefill) replica hands its blocks to a decode replica.
        do_remote_prefill: this (decode) replica pulls the blocks a prefill replica computed.
        remote_engine_id, remote_host, remote_port: the prefill replica's id and side channel.
        remote_block_ids: the prefill replica's blocks of the prompt's full blocks, in order.
        remote_request_id: the prefill replica's hold (what its ranks serve the blocks under).
        tp_size, block_size: the prefill replica's tensor-parallel degree and block size (0: not said).
        kv_cache_dtype: the prefill replica's ``--kv-cache-dtype`` ("": not said, as before it was sent).
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str = ""
    remote_host: str = ""
    remote_port: int = 0
    remote_block_ids: list[int] = field(default_factory=list)
    remote_request_id: str = ""
    tp_size: int = 0
    block_size: int = 0
    kv_cache_dtype: str = ""


def parse_params(text: str) -> KVTransferParams:
    """Reads ``kv_transfer_params_json``.

    Raises:
        InvalidArgumentError: not a JSON object, a field of the wrong type, both directions set,
            or a remote prefill without its side channel; the message names the field.
    """
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InvalidArgumentError(f"{FIELD} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"{FIELD} must be a JSON object")
    params = KVTransferParams(
        do_remote_decode=_get(data, "do_remote_decode", bool, False),
        do_remote_prefill=_get(data, "do_remote_prefill", bool, False),
        remote_engine_id=_get(data, "remote_engine_id", str, ""),
        remote_host=_get(data, "remote_host", str, ""),
        remote_port=_get(data, "remote_port", int, 0),
        remote_block_ids=_get(data, "remote_block_ids", list, []),
        remote_request_id=_get(data, "remote_request_id", str, ""),
        tp_size=_get(data, "tp_size", int, 0),
        block_size=_get(data, "block_size", int, 0),
        kv_cache_dtype=_get(data, "kv_cache_dtype", str, ""))
    if params.do_remote_decode and params.do_remote_prefill:
        raise InvalidArgumentError(f"{FIELD}: do_remote_decode and do_remote_prefill cannot both be true")
    ids = params.remote_block_ids
    if len(ids) > MAX_BLOCKS or not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 2**31
                                        for b in ids):
        raise InvalidArgumentError(f"{FIELD}.remote_block_ids must be at most {MAX_BLOCKS} block ids in [0, 2^31)")
    if params.do_remote_prefill and ids:
        if not params.remote_host or not 1 <= params.remote_port <= 65535:
            raise InvalidArgumentError(f"{FIELD}: remote_host must be set and remote_port in [1, 65535]")
        if not params.remote_request_id:
            raise InvalidArgumentError(f"{FIELD}.remote_request_id must name the prefill replica's hold")
    return params


def _get(data: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = data.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidArgumentError(f"{FIELD}.{name} must be a JSON {kind.__name__}, got {type(value).__name__}")
    return value


def handoff_json(engine_id: str, host: str, port: int, block_ids: list[int], transfer_id: str, tp_size: int,
                 block_size: int, kv_cache_dtype: str = "auto") -> str:
    """The prefill's GenerateComplete ``kv_transfer_params_json`` the gateway forwards to the decode replica."""
    return json.dumps({"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
                       "remote_block_ids": block_ids, "remote_host": host, "remote_port": port,
                       "remote_request_id": transfer_id, "tp_size": tp_size, "block_size": block_size,
                       "kv_cache_dtype": kv_cache_dtype})
