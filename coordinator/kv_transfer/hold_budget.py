"""How many KV blocks a producer replica lets hand-offs hold, in all and per tenant.

A hand-off (``do_remote_decode``) keeps its prompt's blocks referenced until the decode replica
pulls them or ``hold_timeout_s`` passes. Unbounded, one tenant's unpulled hand-offs pinned the
whole pool (66 in 9.7 s took its usage to 0.999) and another tenant's request waited past its
deadline. So a hand-off reserves its blocks before it is queued and is refused with
RESOURCE_EXHAUSTED (with pushback) when the reservation would pass
``kv_connector_extra_config.max_hold_fraction`` of the pool in all, or
``max_hold_fraction_per_tenant`` for one API-key tenant (the anonymous tenant, a gateway's, is
bounded by the total only: every caller without a key is that one tenant). The reservation
becomes the hold's and ends with it. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.errors import ResourceExhaustedError

#: Milliseconds a refused hand-off is told to wait: a hold ends when its decode replica pulls (milliseconds
#: after the prefill, behind a gateway) or at hold_timeout_s.
RETRY_PUSHBACK_MS = 1000


@dataclass
class HoldReservation:
    """Blocks a hand-off may hold, counted against its tenant and the total until :meth:`release`.

    Attributes:
        tenant: the API-key tenant ("" anonymous).
        num_blocks: the blocks reserved (0 once released).
    """

    tenant: str
    num_blocks: int
    budget: HoldBudget | None = field(default=None, repr=False)

    def take(self) -> HoldReservation:
        """Moves the blocks into a new reservation (the hold's), leaving this one empty: the request's own
        release at its end is then a no-op, and the hold's release returns them."""
        taken = HoldReservation(self.tenant, self.num_blocks, self.budget)
        self.num_blocks = 0
        return taken

    def release(self) -> None:
        """Returns the blocks to the budget (idempotent)."""
        if self.budget is not None and self.num_blocks:
            self.budget._release(self.tenant, self.num_blocks)
        self.num_blocks = 0


class HoldBudget:
    """The hand-offs' share of the pool.

    Args:
        max_fraction: the share of the pool every hold together may take, in (0, 1].
        max_fraction_per_tenant: the share one API-key tenant's holds may take, in (0, 1].
    """

    def __init__(self, max_fraction: float, max_fraction_per_tenant: float) -> None:
        self.max_fraction, self.max_fraction_per_tenant = max_fraction, max_fraction_per_tenant
        self.total = 0
        self.by_tenant: dict[str, int] = {}

    def reserve(self, tenant: str, num_blocks: int, pool_blocks: int) -> HoldReservation:
        """Reserves ``num_blocks`` blocks of a pool of ``pool_blocks`` for ``tenant``'s hand-off.

        Raises:
            ResourceExhaustedError: the total or the tenant's share would be passed (pushback
                :data:`RETRY_PUSHBACK_MS`), or the hand-off alone is larger than a share (no retry).
        """
        total_cap = int(self.max_fraction * pool_blocks)
        tenant_cap = int(self.max_fraction_per_tenant * pool_blocks) if tenant else total_cap
        cap, name = min((total_cap, "max_hold_fraction"), (tenant_cap, "max_hold_fraction_per_tenant"))
        field_ = f"kv_transfer_params_json.do_remote_decode: kv_connector_extra_config.{name}"
        if num_blocks > cap:
            raise ResourceExhaustedError(f"{field_} lets hand-offs hold {cap} of this replica's {pool_blocks} KV blocks; "
                                         f"this prompt's need {num_blocks}")
        for used, limit, key in ((self.total, total_cap, "max_hold_fraction"),
                                 (self.by_tenant.get(tenant, 0), tenant_cap, "max_hold_fraction_per_tenant")):
            if used + num_blocks > limit:
                who = "every tenant's" if key == "max_hold_fraction" else "this tenant's"
                raise ResourceExhaustedError(
                    f"kv_transfer_params_json.do_remote_decode: {who} hand-offs hold {used} of this replica's "
                    f"{pool_blocks} KV blocks, and {num_blocks} more would pass kv_connector_extra_config.{key} "
                    f"({limit} blocks); retry once a hand-off is pulled", retry_pushback_ms=RETRY_PUSHBACK_MS)
        self.total += num_blocks
        if tenant:
            self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + num_blocks
        return HoldReservation(tenant, num_blocks, self)

    def _release(self, tenant: str, num_blocks: int) -> None:
        self.total -= num_blocks
        if tenant:
            left = self.by_tenant.get(tenant, 0) - num_blocks
            if left > 0:
                self.by_tenant[tenant] = left
            else:
                self.by_tenant.pop(tenant, None)
