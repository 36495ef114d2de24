"""Fixtures shared by the cluster tests."""

from __future__ import annotations

import pytest

from tests.cluster.k8s import OVERLAYS, render


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    """``(overlay, its rendered objects)`` for each kustomize overlay (k8s/overlays/*), rendered once a module."""
    return request.param, render(f"k8s/overlays/{request.param}")
