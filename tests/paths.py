"""Where the tests find the read-only shared assets (the real model and its goldens).

``../shared`` sits beside the repository on developer machines and in CI; set
``TPSERVE_SHARED_DIR`` to point elsewhere. Tests that need it are skipped, with the
reason, on a machine that has none (a fresh clone elsewhere).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = Path(os.environ.get("TPSERVE_SHARED_DIR", REPO_ROOT.parent / "shared"))
STORIES_DIR = SHARED_DIR / "models" / "stories260k"
GOLDENS_PATH = SHARED_DIR / "goldens" / "stories260k-greedy.jsonl"

requires_stories = pytest.mark.skipif(
    not ((STORIES_DIR / "config.json").is_file() and GOLDENS_PATH.is_file()),
    reason=f"the shared stories260k model and goldens are not under {SHARED_DIR} (set TPSERVE_SHARED_DIR)",
)


def load_goldens() -> list[dict]:
    """Every line of the stories260k greedy goldens; [] where ../shared is absent.

    Empty only so that test modules can parametrize over it at import time; those
    modules are marked ``requires_stories`` and so are skipped, with the reason.
    """
    if not GOLDENS_PATH.is_file():
        return []
    return [json.loads(line) for line in GOLDENS_PATH.read_text().splitlines() if line.strip()]
