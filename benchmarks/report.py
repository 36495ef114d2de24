"""Where every benchmark writes its recorded result (one JSON file per run)."""

from __future__ import annotations

import json
from pathlib import Path


def save_report(out_dir: Path, filename: str, report: dict) -> Path:
    """Write ``report`` as indented JSON to ``out_dir / filename`` (the directory is created); returns the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / filename
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
