"""NCCL's failure handling and diagnostics, set in each rank process before its process group exists.

Policy (docs/design/gpu.md, "NCCL failures"): NCCL collectives run asynchronously on
a CUDA stream, so a lost or hung peer is not seen by the Python call that issued
the collective; PyTorch's watchdog thread sees it when the collective exceeds
the group's timeout (``--distributed-timeout-seconds``) or NCCL reports an error,
and then tears the rank process down. The coordinator treats a rank's exit like
any lost rank: it fails the requests in flight and stops the group, for the
orchestrator to restart it. Before the process dies, the flight recorder writes
the last collectives of the rank to a file, so that the hang can be diagnosed.

PyTorch reads these variables when a NCCL process group is created; only unset
ones are filled in, so an operator can override any of them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import MutableMapping

#: Variable -> default, with the reason. Names from PyTorch's ProcessGroupNCCL.
NCCL_ENV_DEFAULTS: dict[str, str] = {
    # On a failed or timed-out collective the watchdog ends the process without
    # trying to clean the communicator up (3, "SkipCleanUp"): cleanup can itself
    # hang on a dead peer. The coordinator sees the exit.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    # Flight recorder: keep the last 2,000 collectives per rank ...
    "TORCH_FR_BUFFER_SIZE": "2000",  # TORCH_NCCL_TRACE_BUFFER_SIZE before torch 2.6 (now deprecated)
    # ... and dump them when a collective times out.
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    # The heartbeat monitor ends a rank whose watchdog itself is stuck.
    "TORCH_NCCL_ENABLE_MONITORING": "1",
    # NCCL's own warnings (a peer lost, a transport failed) reach the rank's log.
    "NCCL_DEBUG": "WARN",
}


def configure_nccl_env(environ: MutableMapping[str, str] | None = None, dump_dir: str | None = None) -> dict[str, str]:
    """Fill in the NCCL variables this process has not set.

    Args:
        environ: the environment to change (default ``os.environ``).
        dump_dir: directory of the flight recorder dumps (default: the system
            temporary directory); files are ``tpserve_nccl_trace_rank_<rank>``.

    Returns:
        The variables it set (name -> value); the ones already set are left alone.
    """
    environ = os.environ if environ is None else environ
    wanted = dict(NCCL_ENV_DEFAULTS)
    wanted["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = os.path.join(dump_dir or tempfile.gettempdir(), "tpserve_nccl_trace_rank_")
    added = {name: value for name, value in wanted.items() if name not in environ}
    environ.update(added)
    return added
