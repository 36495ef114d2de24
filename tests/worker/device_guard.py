"""A dispatch mode that records every op touching a tensor off one device, or syncing with the host.

Used on ``device="meta"`` (tests/worker/test_meta_forward.py, test_mla.py): a meta tensor has no
data, so a host sync inside a layer raises there, and a tensor created on the wrong device
(a ``torch.arange`` without ``device=``) is recorded even where the meta kernel would accept it.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class DeviceGuard(TorchDispatchMode):
    """Records every aten op whose tensor inputs or outputs are off ``device`` (0-dim scalars aside)."""

    def __init__(self, device: str = "meta") -> None:
        super().__init__()
        self.device = device
        self.violations: list[str] = []
        self.num_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.num_ops += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.violations.append(f"{func}: host sync")
        out = func(*args, **kwargs)
        for where, tensors in (("input", (args, kwargs)), ("output", out)):
            for t in tree_leaves(tensors):
                if isinstance(t, torch.Tensor) and t.device.type != self.device and t.dim() > 0:
                    self.violations.append(f"{func}: {where} on {t.device}, shape {tuple(t.shape)}")
        return out
