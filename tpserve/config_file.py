"""``--config``: the YAML file of configuration sections (tpserve/config.py merges the flags over it).

What makes the file unusable is a ``ValueError`` of one line naming the file, as the CLI prints it
(exit status 2): a syntax error names the line and column where parsing stopped
(``--config bad.yaml: line 2, column 1: expected ',' or '}', but got '<stream end>'``), not
PyYAML's ``"<unicode string>"`` and its traceback.

No torch here: the coordinator reads this too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def read_config_file(yaml_path: str | Path) -> dict[str, dict[str, Any]]:
    """The file's sections, ``{section: {field: value}}``; an empty file or section holds none.

    Raises:
        OSError: the file cannot be read.
        ValueError: not YAML, not a mapping of sections, or a section that is not a mapping of fields;
            the message starts with ``--config <yaml_path>``.
    """
    try:
        # Bytes, not text: PyYAML detects the encoding, and an undecodable byte is a YAMLError like the rest.
        loaded = yaml.safe_load(Path(yaml_path).read_bytes()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {yaml_path}: {_where(exc)}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"--config {yaml_path}: expected a mapping of sections, got {type(loaded).__name__}")
    for section, values in loaded.items():
        if values is not None and not isinstance(values, dict):
            raise ValueError(f"--config {yaml_path}: section {section}: expected a mapping of fields, got "
                             f"{type(values).__name__}")
    return {section: dict(values or {}) for section, values in loaded.items()}


def _where(exc: yaml.YAMLError) -> str:
    """Where parsing stopped and why, in one line (PyYAML's own text spans several, and names the
    string it parsed rather than the file)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    # A ReaderError (an undecodable byte, a control character): where, in characters from the start.
    position = getattr(exc, "position", None)
    reason = str(exc).splitlines()[0]
    return reason if position is None else f"position {position}: {reason}"
