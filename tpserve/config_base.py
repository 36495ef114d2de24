"""What every section of the configuration shares (tpserve/config.py and its section modules).

No torch here: the coordinator reads this too.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

#: Largest count a request or step field carries on the wire (protobuf ``int32``): a token, sequence or
#: block count above it would be refused by the first message that carries it, after start-up.
INT32_MAX = 2**31 - 1


class FrozenSection(BaseModel):
    """A configuration section: frozen, no unknown keys, every float finite.

    allow_inf_nan=False: ``--step-timeout-seconds inf`` would pass ``gt=0`` and fail later as a
    timedelta overflow (a traceback from a rank).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
