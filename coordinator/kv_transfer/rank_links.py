"""The coordinator's calls to its own ranks' KV agents (tpserve/kv_wire.py; worker/kv_transfer/agent.py).

Each call is one TCP connection to one rank, awaited on the event loop: the ranks' agent
threads copy the bytes, the engine loop goes on stepping meanwhile. Every call proves the group's
control key (launch/local_ranks.py), which only this coordinator and its ranks hold, and checks
the agent's answers under the same session (tpserve/kv_wire.py). No torch.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from tpserve.kv_wire import FrameMac, WireError, caller_session, open_async, read_async, write_async

#: Seconds to reach a local agent and hear it answer a hold.
CONNECT_TIMEOUT_S = 5.0


@dataclass
class RankHold:
    """One rank's hold of a transfer: the open connection whose ``done`` ends it."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    mac: FrameMac

    async def done(self, timeout_s: float) -> dict[str, Any]:
        """Waits for the agent's ``done`` (``confirmed``: the peer read the blocks): the blocks may be
        freed after it. A connection that breaks, or no answer in ``timeout_s``, also ends the hold:
        ``{"confirmed": False}`` (the agent drops a hold whose coordinator hung up)."""
        try:
            return await asyncio.wait_for(read_async(self.reader, self.mac), timeout_s)
        except (OSError, WireError, asyncio.TimeoutError):
            return {"confirmed": False}
        finally:
            await self.close()

    async def release(self) -> None:
        """Ends the hold now (the agent answers ``done``)."""
        with contextlib.suppress(OSError):
            await write_async(self.writer, {"op": "release"}, self.mac)

    async def close(self) -> None:
        """Closes the connection (the agent drops the hold if it still had it)."""
        self.writer.close()
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)


async def hold(host: str, port: int, control_key: str, transfer_id: str, block_ids: list[int],
               block_hashes: list[str], namespace: str, timeout_s: float) -> RankHold:
    """Asks the agent at ``host:port`` to hold ``block_ids`` for a pull, for ``timeout_s`` seconds at most,
    proving ``control_key`` (the group's).

    Raises:
        OSError, asyncio.TimeoutError, WireError: the agent cannot be reached, refused, or failed to prove the key.
    """
    reader, writer, agent_nonce = await open_async(host, port, CONNECT_TIMEOUT_S)
    try:
        nonce, mac = caller_session(control_key, "hold", agent_nonce)
        await write_async(writer, {"op": "hold", "nonce": nonce, "transfer_id": transfer_id, "block_ids": block_ids,
                                   "block_hashes": block_hashes, "namespace": namespace, "timeout_s": timeout_s}, mac)
        answer = await asyncio.wait_for(read_async(reader, mac), CONNECT_TIMEOUT_S)
        if not answer.get("ok"):
            raise WireError(f"the agent refused the hold: {answer.get('error')}")
    except BaseException:
        writer.close()
        raise
    return RankHold(reader, writer, mac)


async def pull(host: str, port: int, control_key: str, request: dict[str, Any]) -> dict[str, Any]:
    """Asks the agent at ``host:port`` to pull a transfer into local blocks; returns its ``pulled`` answer
    (``ok``, ``bytes``, ``seconds`` or ``error``). Waits for the answer however long it takes (the
    agent's own timeout bounds it): the blocks must not be freed while a rank may still write them.

    Raises:
        OSError, asyncio.TimeoutError, WireError: the agent cannot be reached, hung up, or failed to prove the key.
    """
    reader, writer, agent_nonce = await open_async(host, port, CONNECT_TIMEOUT_S)
    try:
        nonce, mac = caller_session(control_key, "pull", agent_nonce)
        await write_async(writer, {"op": "pull", "nonce": nonce, **request}, mac)
        return await read_async(reader, mac)
    finally:
        writer.close()
