"""Process launching: the only package that imports the coordinator.

``tpserve serve`` (:mod:`launch.cli`) runs a :class:`~launch.leader.Leader` (coordinator, public
server and this host's ranks) or, with ``--headless``, a :class:`~launch.headless.HeadlessNode`
(ranks only, no coordinator module imported). One idea per module:

- :mod:`launch.startup`: checks both kinds of node make before starting anything;
- :mod:`launch.public_server`: the public gRPC port, health, model info, TLS and API keys;
- :mod:`launch.group_launcher`: the leader's worker group, local ranks and the node registry;
- :mod:`launch.local_ranks`: one host's rank processes, each given its ``RankConfig`` as JSON;
- :mod:`launch.node_registry`: which hosts of a multi-host group have joined;
- :mod:`launch.topology`: where each rank runs and which ports a group uses; :mod:`launch.netutil`: peers;
- :mod:`launch.recovery`: liveness, restart-and-resume of a lost group;
- :mod:`launch.shutdown`: the ordered stop.

Import rules (tests/test_import_rules.py): ``coordinator`` imports no torch and no worker;
``worker`` imports neither coordinator nor launch; ``tpserve`` (shared) imports none of the three.
"""

import os

# gRPC's C core logs in its own format straight to stderr (a port in use: an add_port.cc E-line before
# ours; fork_posix.cc lines from the ranks). It reads this once, at its first channel or server, which a
# module imported by the coordinator may already create: so here, before any of them, and inherited by the
# ranks. A user who sets GRPC_VERBOSITY (debug) keeps it. tpserve/log.py says what reaches the log.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")
