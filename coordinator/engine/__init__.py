"""The engine (docs/design/scheduling.md, "The engine loop"): :class:`Engine` is the facade; coordinator/engine/facade.py lists the parts."""

from coordinator.engine.facade import Engine
from coordinator.request_output import RequestOutput

__all__ = ["Engine", "RequestOutput"]
