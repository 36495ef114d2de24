"""How closely int8 weights must follow the goldens, shared by the worker's and the serving int8 tests."""

from __future__ import annotations

GOLDEN_MIN_PREFIX = 16
GOLDEN_MIN_FULL_LINES = 4
