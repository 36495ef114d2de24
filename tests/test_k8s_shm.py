"""Every Kubernetes workload that runs tpserve mounts a memory-backed /dev/shm.

A container's /dev/shm is 64 MiB by default; NCCL's shared-memory transport (and
the CPU ranks' shared-memory all-reduce) need more, and fail or fall back to
slower paths without it. The check reads every manifest under k8s/ and, for each
pod template whose containers run ``tpserve serve`` (the ``tpserve`` image's ENTRYPOINT), requires a ``/dev/shm``
mount of an ``emptyDir`` volume with ``medium: Memory`` and a ``sizeLimit``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import yaml

K8S_DIR = Path(__file__).resolve().parents[1] / "k8s"


def _pod_specs(node: object) -> Iterator[dict]:
    """Every mapping with a ``containers`` list, at any depth (Deployment, LeaderWorkerSet, ...)."""
    if isinstance(node, dict):
        if isinstance(node.get("containers"), list):
            yield node
        for value in node.values():
            yield from _pod_specs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _pod_specs(value)


def _runs_tpserve(container: dict) -> bool:
    """The container runs ``tpserve serve``: the tpserve image with its ENTRYPOINT (a ``command``
    runs something else from the image, e.g. the model download Job's ``hf download``)."""
    image = str(container.get("image", ""))
    return image.rsplit("/", 1)[-1].split(":")[0] == "tpserve" and "command" not in container


def test_tpserve_pods_mount_a_memory_backed_dev_shm() -> None:
    checked = 0
    for path in sorted(K8S_DIR.rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            for spec in _pod_specs(document):
                containers = [c for c in spec["containers"] if _runs_tpserve(c)]
                if not containers:
                    continue
                volumes = {v["name"]: v for v in spec.get("volumes", [])}
                for container in containers:
                    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
                    assert "/dev/shm" in mounts, f"{path.name}: container {container['name']} has no /dev/shm mount"
                    empty_dir = volumes[mounts["/dev/shm"]].get("emptyDir", {})
                    assert empty_dir.get("medium") == "Memory" and empty_dir.get("sizeLimit"), (path.name, empty_dir)
                    checked += 1
    assert checked >= 1, "no manifest under k8s/ runs the tpserve image"
