"""``tpserve serve`` refuses a model whose config.json is nonsense: exit code 2, one line, no traceback.

Each model here is the embedded default model (tpserve/default_model/) with one value of its
config.json changed; each used to start a server that answered NaN or garbage (rope_theta 0
silently became 10000), refused every request (a dynamic RoPE factor of 0), or served an
untied model with its embedding as the LM head.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cluster import free_port
from tests.paths import REPO_ROOT
from tpserve.embedded_model import default_model_dir

pytestmark = pytest.mark.e2e


def _model_with(config_changes: dict, into: Path) -> Path:
    """The default model's files, linked into ``into``, with ``config_changes`` applied to its config.json."""
    source = default_model_dir()
    into.mkdir()
    for path in source.iterdir():
        if path.name != "config.json":
            (into / path.name).symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    (into / "config.json").write_text(json.dumps({**config, **config_changes}))
    return into


@pytest.mark.parametrize(("changes", "named"), [
    ({"rope_theta": 0}, "config.json rope_theta=0 must be a finite number > 0"),
    ({"rms_norm_eps": "nan"}, 'config.json rms_norm_eps="nan" must be a finite number > 0'),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 0}},
     "config.json rope_scaling.factor=0 must be a finite number >= 1"),
    ({"tie_word_embeddings": False}, "config.json tie_word_embeddings=false but the checkpoint has no lm_head.weight"),
], ids=["rope-theta-0", "rms-norm-eps-nan", "dynamic-factor-0", "untied-without-lm-head"])
def test_serve_refuses_nonsense_in_one_line_with_exit_code_2(tmp_path: Path, changes: dict, named: str) -> None:
    model = _model_with(changes, tmp_path / "model")
    out = subprocess.run([sys.executable, "-m", "launch.cli", "serve", "--model", str(model),
                          "--port", str(free_port())], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"tpserve serve: cannot serve {model}: ") and named in lines[0], lines[0]
