"""The install paths: deploy/Dockerfile installs as deploy/setup.sh does, and a set-up re-run is quick.

No docker daemon here: the Dockerfile is parsed and its stages checked against pyproject.toml,
deploy/setup.sh, the README and the Kubernetes overlays.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs of a Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def _stages(text: str) -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for word, rest in _instructions(text):
        if word == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            current = match.group(2)
            stages[current] = [("FROM", match.group(1))]
        elif current is not None:
            stages[current].append((word, rest))
    return stages


def _lineage(stages, name: str) -> list[tuple[str, str]]:
    """A stage's instructions after those of the stages it is built FROM."""
    own = stages[name]
    parent = own[0][1]
    return (_lineage(stages, parent) if parent in stages else []) + own[1:]


def test_dockerfile_stages_install_with_setup_sh():
    text = DOCKERFILE.read_text()
    stages = _stages(text)
    assert list(stages)[-1] == "cpu", "the default target (the last stage) is the CPU image"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = sorted(p.name for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
                      for p in ROOT.glob(pattern) if (p / "__init__.py").is_file())
    assert packages == ["coordinator", "launch", "tpserve", "worker"]
    setup_options = set(re.findall(r"^\s+(--\w+)\)", (ROOT / "deploy" / "setup.sh").read_text(), re.MULTILINE))
    for target, kind in (("cpu", "--cpu"), ("gpu", "--gpu")):
        steps = _lineage(stages, target)
        copied = {path for word, rest in steps if word == "COPY" for path in shlex.split(rest)[:-1]}
        for needed in ["pyproject.toml", "README.md", "deploy/setup.sh", *packages]:
            assert needed in copied, f"{target}: {needed} is not copied into the image"
        runs = " ; ".join(rest for word, rest in steps if word == "RUN")
        assert f"bash deploy/setup.sh {kind}" in runs, f"{target}: not installed by deploy/setup.sh {kind}"
        assert kind in setup_options
        assert "pip install" not in runs, f"{target}: installs packages beside deploy/setup.sh"
        assert "--test" not in runs, f"{target}: an image serves; it needs no test extra"
        env = " ".join(rest for word, rest in steps if word == "ENV")
        assert "PATH=/opt/tpserve/.venv/bin:" in env
        entry = [rest for word, rest in steps if word == "ENTRYPOINT"][-1]
        assert entry.startswith('["tpserve", "serve"') and '"--port", "50051"' in entry
        exposed = " ".join(rest for word, rest in steps if word == "EXPOSE").split()
        assert "50051" in exposed and "9400" in exposed and '"--metrics-port", "9400"' in entry
        assert "50052" in exposed and '"--health-port", "50052"' in entry  # the probes' port (k8s/base)


def test_dockerfile_build_lines_documented_and_match_k8s_tags():
    text = DOCKERFILE.read_text()
    builds = re.findall(r"docker build -f deploy/Dockerfile --target (\w+) -t (tpserve:\S+) \.", text)
    assert dict(builds) == {"cpu": "tpserve:0.1.0", "gpu": "tpserve:0.1.0-cuda"}
    readme = (ROOT / "README.md").read_text()
    for target, tag in builds:
        assert f"docker build -f deploy/Dockerfile --target {target} -t {tag} ." in readme
        assert "docker run " in readme and tag in readme
    for overlay, tag in (("cpu", "0.1.0"), ("gpu", "0.1.0-cuda")):
        kustomization = (ROOT / "k8s" / "overlays" / overlay / "kustomization.yaml").read_text()
        assert f"newTag: {tag}" in kustomization


def _stamp_matches() -> bool:
    stamp = ROOT / ".venv" / ".tpserve-setup"
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    return stamp.is_file() and f"pyproject {digest} " in stamp.read_text() and stamp.read_text().rstrip().endswith(
        "extras test")


@pytest.mark.skipif(not _stamp_matches(), reason=".venv was not set up by `deploy/setup.sh --test` from this "
                                                 "pyproject.toml (a re-run would install, not check)")
def test_setup_rerun_is_quick_and_says_each_step():
    for args in (["--test"], []):  # the test set-up covers a serve-only request
        start = time.monotonic()
        run = subprocess.run(["bash", "deploy/setup.sh", *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        elapsed = time.monotonic() - start
        assert run.returncode == 0, run.stderr
        lines = run.stdout.splitlines()
        assert [line.split(":")[1].strip() for line in lines] == ["venv", "packages", "kernels", "done"], lines
        assert all(re.search(r"\(\d+\.\d s\)$", line) for line in lines), lines
        assert "up to date" in lines[1] and "cached" in lines[2], lines
        assert elapsed < 5, f"a set-up re-run took {elapsed:.1f} s"
