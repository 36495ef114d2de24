"""deploy/images.sh builds exactly the images the manifests run, from Dockerfiles that exist.

No docker daemon here: the script's ``--print`` mode gives the exact commands it would run,
which are parsed and checked against the Dockerfiles (file and stage), the image names of
every rendered overlay and k8s/loadtest, and a registry set once with kustomize's ``images:``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess

import pytest
import yaml

from tests.cluster.k8s import OVERLAYS, render
from tests.paths import REPO_ROOT

REGISTRY = "registry.example.com/llm"


def images_sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO_ROOT / "deploy" / "images.sh"), *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO_ROOT)


def printed(*args: str) -> list[list[str]]:
    """The commands ``images.sh --print ARGS`` would run, each as its argv."""
    out = images_sh("--print", *args)
    assert out.returncode == 0, out.stderr
    return [shlex.split(line) for line in out.stdout.splitlines()]


def option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def stages(dockerfile: str) -> list[str]:
    """The named stages of a Dockerfile (``FROM image AS name``)."""
    return re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (REPO_ROOT / dockerfile).read_text(), re.MULTILINE | re.IGNORECASE)


def pod_images(docs: list[dict]) -> set[str]:
    """Every image of every container and init container in the documents."""
    found: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key in ("containers", "initContainers"):
                if isinstance(node.get(key), list):
                    found.update(c["image"] for c in node[key])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(docs)
    return found


def test_every_build_names_an_existing_dockerfile_and_stage_and_pushes_what_it_built() -> None:
    commands = printed("--registry", REGISTRY + "/", "--push")
    builds = [c for c in commands if c[:2] == ["docker", "build"]]
    pushes = [c for c in commands if c[:2] == ["docker", "push"]]
    assert len(builds) == len(pushes) == 4 and len(commands) == 8
    for build in builds:
        dockerfile, target, ref = option(build, "-f"), option(build, "--target"), option(build, "-t")
        assert (REPO_ROOT / dockerfile).is_file() and build[-1] == "."  # the repository root is the context
        assert target is None or target in stages(dockerfile), (dockerfile, target)
        assert ref.startswith(REGISTRY + "/") and "//" not in ref
    assert [option(b, "-t") for b in builds] == [p[2] for p in pushes]  # each push follows its build
    assert {(option(b, "-f"), option(b, "--target")): option(b, "-t").removeprefix(REGISTRY + "/") for b in builds} == {
        ("deploy/Dockerfile", "cpu"): "tpserve:0.1.0",
        ("deploy/Dockerfile", "gpu"): "tpserve:0.1.0-cuda",
        ("k8s/components/gateway/Dockerfile", None): "tpserve-gateway:0.1.0",
        ("k8s/loadtest/Dockerfile", None): "tpserve-loadtest:0.1.0",
    }


def test_the_images_built_are_exactly_those_the_manifests_run() -> None:
    built = {option(c, "-t") for c in printed() if c[:2] == ["docker", "build"]}
    used = set()
    for overlay in OVERLAYS:
        used |= pod_images(render(f"k8s/overlays/{overlay}"))
    used |= pod_images(render("k8s/loadtest"))
    assert used == built


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o.startswith("gpu")])
def test_a_gpu_overlay_runs_one_tpserve_image(overlay: str) -> None:
    """A GPU cluster pushes the CUDA image (deploy/images.sh gpu): the download Job and the init containers
    that wait for the checkpoint must not ask for the CPU one (gpu-llama-405b did: ImagePullBackOff)."""
    tpserve = {image for image in pod_images(render(f"k8s/overlays/{overlay}")) if "gateway" not in image}
    assert tpserve == {"tpserve:0.1.0-cuda"}


def site_overlay_from_the_docs() -> dict:
    """The site overlay docs/kubernetes.md tells the reader to write (the YAML block after its path)."""
    doc = (REPO_ROOT / "docs" / "kubernetes.md").read_text()
    (block,) = re.findall(r"```yaml\n# k8s/overlays/site/kustomization.yaml\n(.*?)```", doc, re.DOTALL)
    return yaml.safe_load(block)


def test_a_registry_set_once_with_kustomize_images_reaches_every_pod(tmp_path) -> None:
    """docs/kubernetes.md's site overlay over gpu-llama-8b names the registry once; every container
    (the download Job's, the init containers, the gateway's) then pulls what ``images.sh --registry`` pushed."""
    pushed = {option(c, "-t") for c in printed("--registry", REGISTRY, "--push", "gpu", "gateway")
              if c[:2] == ["docker", "build"]}
    site = site_overlay_from_the_docs()
    assert site["resources"] == ["../gpu-llama-8b"]
    # The same overlay, written outside the repository: its base by a relative path (kustomize takes no absolute one).
    site["resources"] = [os.path.relpath(REPO_ROOT / "k8s" / "overlays" / "gpu-llama-8b", tmp_path)]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(site))
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run(["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert pod_images(docs) == pushed == {f"{REGISTRY}/tpserve:0.1.0-cuda", f"{REGISTRY}/tpserve-gateway:0.1.0"}
    import kubernetes_validate

    for doc in docs:  # no LeaderWorkerSet in gpu-llama-8b: every kind is a core one
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_the_docs_name_only_overlays_that_exist_and_the_commands_the_script_prints() -> None:
    doc = (REPO_ROOT / "docs" / "kubernetes.md").read_text()
    named = set(re.findall(r"k8s/overlays/([\w.-]+)", doc)) - {"site"}
    assert named == set(OVERLAYS)  # every overlay documented, none that does not exist
    # Every other YAML block is an excerpt, word for word, of a manifest that test_k8s.py renders.
    manifests = "\n".join(p.read_text() for p in (REPO_ROOT / "k8s").rglob("*.yaml"))
    excerpts = [b for b in re.findall(r"```yaml\n(.*?)```", doc, re.DOTALL) if not b.startswith("# k8s/overlays/site/")]
    assert excerpts and all(block in manifests for block in excerpts)
    example = re.search(r"\$ (deploy/images.sh --print [^\n]*)\n(.*?)```", doc, re.DOTALL)
    assert printed(*shlex.split(example.group(1))[2:]) == [shlex.split(line) for line in example.group(2).splitlines()]


def test_buildx_builds_and_pushes_several_platforms_in_one_command() -> None:
    commands = printed("--registry", REGISTRY, "--platform", "linux/amd64,linux/arm64", "--push", "cpu")
    assert commands == [["docker", "buildx", "build", "--platform", "linux/amd64,linux/arm64", "-f", "deploy/Dockerfile",
                         "--target", "cpu", "-t", f"{REGISTRY}/tpserve:0.1.0", "--push", "."]]
    assert printed("--platform", "linux/amd64", "gateway")[0][-2] == "--load"  # one platform: into the local docker


@pytest.mark.parametrize("args, message", [
    (["gpus"], "unknown argument 'gpus'"),
    (["--platform", "linux/amd64,linux/arm64"], "need --push"),
    (["--registry"], "--registry needs a value"),
    (["--push", "cpu"], "--push needs --registry"),  # else Docker Hub library/tpserve
])
def test_bad_arguments_exit_2_and_say_why(args, message) -> None:
    out = images_sh("--print", *args)
    assert (out.returncode, out.stdout) == (2, "") and message in out.stderr
