"""The real-checkpoint overlays (docs/kubernetes.md): where the weights come from, and what the pods are sized for.

cpu-qwen3-0.6b, gpu-llama-8b and gpu-llama-405b download a Hugging Face repository into a
PersistentVolumeClaim with a one-shot Job (k8s/components/model-pvc); gpu-llama-8b-hostpath
reads it from the node. Checked here, offline: the Job's ``hf download`` command line parses
with huggingface_hub's own CLI into the directory the pods pass as ``--model``, and fetches
what tpserve loads; the pods mount it read-only and wait for the marker the Job writes (both
shell commands run for real); the claim is shared between nodes; the sizing in the docs and
the manifests follows from each model's config.json (parsed by tpserve's ModelConfig, the KV
bytes by the ranks' KVCacheLayout); rollouts never take every replica down at once.
Kinds and schemas: test_k8s.py (which renders every overlay).
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from tests.cluster.k8s import LAYOUTS, MODEL_PVC_OVERLAYS, by_kind, parse_container, pod_templates, render
from tests.paths import REPO_ROOT
from tpserve.model_config import ModelConfig
from worker.kv_cache import KVCacheLayout

#: The real-checkpoint overlays and the Hugging Face repository each serves.
REPOS = {
    "cpu-qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "gpu-llama-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "gpu-llama-8b-hostpath": "meta-llama/Llama-3.1-8B-Instruct",
    "gpu-llama-405b": "meta-llama/Llama-3.1-405B-Instruct",
}
REAL_OVERLAYS = tuple(REPOS)
MARKER = ".tpserve-download-complete"
GIB, KIB = 2**30, 2**10
#: An H100 80 GB as torch.cuda.mem_get_info reports its total.
H100_BYTES = 79.6 * GIB

_LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}
#: The keys of each repository's config.json that sizing needs (as published on the Hub).
CONFIGS = {
    "Qwen/Qwen3-0.6B": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_hidden_layers=28, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000, tie_word_embeddings=True, torch_dtype="bfloat16"),
    "meta-llama/Llama-3.1-8B-Instruct": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
        tie_word_embeddings=False, torch_dtype="bfloat16"),
    "meta-llama/Llama-3.1-405B-Instruct": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=16384, intermediate_size=53248,
        num_attention_heads=128, num_key_value_heads=8, num_hidden_layers=126, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
        tie_word_embeddings=False, torch_dtype="bfloat16"),
}
#: What docs/kubernetes.md and the manifests' comments state: (weights a GPU or a CPU pod in GiB,
#: KV cache bytes a token a rank in KiB), rounded as written there.
DOCUMENTED = {
    "cpu-qwen3-0.6b": (2.2, 112),
    "gpu-llama-8b": (7.5, 64),
    "gpu-llama-405b": (47.2, 31.5),
}
#: The files of meta-llama/Llama-3.1-8B-Instruct (its repository's listing): tpserve loads the
#: first group; original/ holds the same weights as one .pth that tpserve does not read.
LLAMA_8B_FILES = {
    "needed": ["config.json", "generation_config.json", "model.safetensors.index.json", "special_tokens_map.json",
               "tokenizer.json", "tokenizer_config.json"] + [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)],
    "skipped": ["original/consolidated.00.pth", "original/tokenizer.model", "LICENSE", "README.md", "USE_POLICY.md",
                ".gitattributes"],
}


@pytest.fixture(scope="module", params=REAL_OVERLAYS)
def real(request) -> tuple[str, list[dict]]:
    return request.param, render(f"k8s/overlays/{request.param}")


def serving_pods(docs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(role, pod template, the container's parsed configuration) of every tpserve pod."""
    out = []
    for role, template, lws_env in pod_templates(docs):
        (container,) = template["spec"]["containers"]
        out.append((role, template, parse_container(container, lws_env)))
    return out


def model_repo(overlay: str, docs: list[dict]) -> str:
    """The repository the overlay serves (the download Job's, where it has one)."""
    repo = REPOS[overlay]
    for config_map in by_kind(docs, "ConfigMap"):
        assert config_map["data"]["MODEL_REPO"] == repo
    return repo


def parameter_count(raw: dict) -> int:
    """Parameters of a dense Llama-style decoder from its config.json (embeddings, attention, MLP, norms)."""
    config = ModelConfig.from_dict(raw)
    h, hd = config.hidden_size, config.head_dim
    attention = h * config.total_num_heads * hd * 2 + h * config.total_num_kv_heads * hd * 2
    layer = attention + 3 * h * config.intermediate_size + 2 * h
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return embeddings + config.num_hidden_layers * layer + h


def kv_bytes_per_token_per_rank(raw: dict, tp: int, pp: int, dtype: torch.dtype) -> float:
    """What one token's K and V take on one rank: its KV heads, the layers of its stage."""
    full = KVCacheLayout.for_model(ModelConfig.from_dict(raw), tp, block_size=1, dtype=dtype).bytes_per_block
    return full / pp


def hf_download_params(args: list[str]) -> dict:
    """``hf download ARGS`` as huggingface_hub's own CLI parses them (nothing is downloaded)."""
    import click
    from huggingface_hub.cli.hf import app

    group = app if isinstance(app, click.Group) else __import__("typer").main.get_command(app)
    command = group.get_command(click.Context(group), "download")
    command = command.materialize() if hasattr(command, "materialize") else command  # lazily loaded in 1.x
    return command.make_context("download", list(args)).params


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of a command's arguments."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)


def test_every_serving_pod_reads_the_checkpoint_from_a_read_only_models_volume(real) -> None:
    overlay, docs = real
    pods = serving_pods(docs)
    assert pods
    for role, template, config in pods:
        spec = template["spec"]
        (container,) = spec["containers"]
        name = model_repo(overlay, docs).split("/")[1]
        assert config.load.model == f"/models/{name}", role
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/models"]["readOnly"] is True
        volume = {v["name"]: v for v in spec["volumes"]}[mounts["/models"]["name"]]
        if overlay.endswith("-hostpath"):
            assert volume["hostPath"] == {"path": "/srv/models", "type": "Directory"}  # missing: the pod waits
            assert "persistentVolumeClaim" not in volume and not spec.get("initContainers")
        else:
            assert volume["persistentVolumeClaim"] == {"claimName": "tpserve-models", "readOnly": True}


def test_the_download_job_fetches_what_tpserve_loads_into_the_served_directory(real) -> None:
    overlay, docs = real
    if overlay not in MODEL_PVC_OVERLAYS:
        assert not by_kind(docs, "Job") and not by_kind(docs, "PersistentVolumeClaim")
        return
    (job,) = by_kind(docs, "Job")
    (config_map,) = by_kind(docs, "ConfigMap")
    env = config_map["data"]
    pod = job["spec"]["template"]["spec"]
    (download,) = pod["initContainers"]
    assert download["command"] == ["hf"] and download["args"][0] == "download"
    assert [ref["configMapRef"]["name"] for ref in download["envFrom"]] == [config_map["metadata"]["name"]]
    params = hf_download_params([expand(arg, env) for arg in download["args"][1:]])
    assert (params["repo_id"], params["revision"]) == (env["MODEL_REPO"], env["MODEL_REVISION"])
    served = {config.load.model for _, _, config in serving_pods(docs)}
    assert {params["local_dir"], env["MODEL_DIR"]} == served  # the Job fills exactly what the pods serve
    if env["MODEL_REPO"] == "meta-llama/Llama-3.1-8B-Instruct":
        from huggingface_hub.utils import filter_repo_objects

        files = LLAMA_8B_FILES["needed"] + LLAMA_8B_FILES["skipped"]
        fetched = set(filter_repo_objects(files, allow_patterns=params["include"], ignore_patterns=params["exclude"]))
        assert fetched == set(LLAMA_8B_FILES["needed"])  # not the 16 GB original/ copy
    token = {e["name"]: e for e in download["env"]}["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token == {"name": "hf-token", "key": "token", "optional": True}  # gated repositories; public ones need none
    for container in pod["initContainers"] + pod["containers"]:  # the Job writes: the claim read-write
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/models"]
        assert not mount.get("readOnly")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["models"] == {"name": "models", "persistentVolumeClaim": {"claimName": "tpserve-models"}}
    # huggingface_hub's caches on scratch space: only the checkpoint's files take room on the claim.
    home = {e["name"]: e.get("value") for e in download["env"]}["HF_HOME"]
    (scratch,) = [m["name"] for m in download["volumeMounts"] if m["mountPath"] == home]
    assert "emptyDir" in volumes[scratch] and not home.startswith("/models")
    assert pod["restartPolicy"] == "OnFailure"  # a failed download resumes in place


def _sh(command: list[str], env: dict[str, str], timeout: float) -> int:
    """Runs a container's ``sh -c`` command here; the exit code, or 124 when it was still running."""
    assert command[:2] == ["sh", "-c"]
    try:
        return subprocess.run(command, env={**os.environ, **env}, timeout=timeout, capture_output=True).returncode
    except subprocess.TimeoutExpired:
        return 124


def test_the_pods_wait_until_the_job_marked_a_complete_checkpoint(real, tmp_path) -> None:
    overlay, docs = real
    if overlay not in MODEL_PVC_OVERLAYS:
        return
    (job,) = by_kind(docs, "Job")
    (mark,) = job["spec"]["template"]["spec"]["containers"]
    model_dir = tmp_path / "models" / "checkpoint"
    model_dir.mkdir(parents=True)
    env = {"MODEL_DIR": str(model_dir)}
    waits = []
    for _, template, _ in serving_pods(docs):
        (wait,) = template["spec"]["initContainers"]
        assert wait["envFrom"] == [{"configMapRef": {"name": "tpserve-model"}}]
        assert {m["mountPath"]: m.get("readOnly") for m in wait["volumeMounts"]} == {"/models": True}
        waits.append(wait["command"])
    assert _sh(waits[0], env, timeout=1.5) == 124  # nothing downloaded: the pod waits
    (model_dir / "config.json").write_text("{}")
    assert _sh(mark["command"], env, timeout=10) != 0  # no tokenizer.json: a broken download is not marked
    assert not (model_dir / MARKER).exists() and _sh(waits[0], env, timeout=1.5) == 124
    (model_dir / "tokenizer.json").write_text("{}")
    assert _sh(mark["command"], env, timeout=10) == 0 and (model_dir / MARKER).is_file()
    for command in waits:  # the leader's and the workers' too
        assert _sh(command, env, timeout=10) == 0


def test_the_claim_is_shared_between_the_nodes_of_every_pod_that_mounts_it(real) -> None:
    overlay, docs = real
    if overlay not in MODEL_PVC_OVERLAYS:
        return
    (claim,) = by_kind(docs, "PersistentVolumeClaim")
    pods = sum(d["spec"]["replicas"] for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "tpserve")
    pods += sum(g["spec"]["replicas"] * g["spec"]["leaderWorkerTemplate"]["size"] for g in by_kind(docs, "LeaderWorkerSet"))
    assert pods >= 2 and claim["spec"]["accessModes"] == ["ReadWriteMany"]  # pods on several nodes mount it
    weights = parameter_count(CONFIGS[model_repo(overlay, docs)]) * 2  # the checkpoint's bf16 safetensors
    size = claim["spec"]["resources"]["requests"]["storage"]
    assert int(re.fullmatch(r"(\d+)(Gi|Ti)", size).group(1)) * {"Gi": GIB, "Ti": 1024 * GIB}[size[-2:]] > 1.2 * weights


def test_gpu_pods_fit_the_weights_and_a_full_sequence_and_the_docs_say_so(real) -> None:
    overlay, docs = real
    if overlay.startswith("cpu"):
        return
    raw = CONFIGS[model_repo(overlay, docs)]
    doc = (REPO_ROOT / "docs" / "kubernetes.md").read_text()
    for _, _, config in serving_pods(docs):
        par = config.parallel
        ModelConfig.from_dict(raw).check_tensor_parallel(par.tensor_parallel_size)
        weights = parameter_count(raw) * 2 / (par.tensor_parallel_size * par.pipeline_parallel_size)  # bf16
        kv_token = kv_bytes_per_token_per_rank(raw, par.tensor_parallel_size, par.pipeline_parallel_size,
                                               torch.bfloat16)
        budget = config.cache.gpu_memory_utilization * H100_BYTES - weights - 3 * GIB  # profiled step, CUDA, NCCL
        assert config.scheduler.max_model_len <= raw["max_position_embeddings"]
        assert budget // kv_token >= 8 * config.scheduler.max_model_len  # 8 full-length sequences at least
        weights_gib, kv_kib = DOCUMENTED[overlay.removesuffix("-hostpath")]
        assert (round(weights / GIB, 1), kv_token / KIB) == (weights_gib, kv_kib)
        assert f"{weights_gib:g} GiB" in doc and f"{kv_kib:g} KiB" in doc


def test_cpu_pods_memory_limit_covers_weights_kv_cache_and_processes(real) -> None:
    overlay, docs = real
    if not overlay.startswith("cpu"):
        return
    raw = CONFIGS[model_repo(overlay, docs)]
    for _, template, config in serving_pods(docs):
        (container,) = template["spec"]["containers"]
        tp = config.parallel.tensor_parallel_size
        # Given: without it a CPU rank sizes its cache from the node's MemAvailable, not the pod's limit.
        kv = config.cache.kv_cache_memory_bytes
        assert kv is not None
        kv_token = kv_bytes_per_token_per_rank(raw, tp, 1, torch.float32)  # --dtype auto: float32 on the CPU
        assert kv // kv_token >= config.scheduler.max_model_len  # the leader refuses a cache below one sequence
        weights = parameter_count(raw) * 4
        assert (round(weights / GIB, 1), kv_token / KIB) == DOCUMENTED[overlay]
        shm = {v["name"]: v for v in template["spec"]["volumes"]}["dshm"]["emptyDir"]["sizeLimit"]
        processes = 1.5 * GIB + tp * 0.5 * GIB  # coordinator + chat templates; each rank's torch runtime
        need = weights + tp * kv + int(shm.removesuffix("Gi")) * GIB + processes
        limit = int(container["resources"]["limits"]["memory"].removesuffix("Gi")) * GIB
        assert need <= limit < need + 4 * GIB  # fits, and not wildly over
        assert container["resources"]["requests"] == container["resources"]["limits"]  # Guaranteed: whole cores


def test_rollouts_drain_one_replica_at_a_time_and_keep_serving(real) -> None:
    _, docs = real
    (budget,) = by_kind(docs, "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1
    for deployment in by_kind(docs, "Deployment"):
        if deployment["metadata"]["name"] != "tpserve":
            continue
        rolling = deployment["spec"]["strategy"]["rollingUpdate"]
        assert (rolling["maxUnavailable"], rolling["maxSurge"]) == (0, 1)  # a new pod Ready before an old one drains
    for lws in by_kind(docs, "LeaderWorkerSet"):
        rolling = lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]
        assert rolling["maxUnavailable"] < lws["spec"]["replicas"]  # another group serves meanwhile
    for role, template, config in serving_pods(docs):
        if role != "worker":  # the gateway and the Services stop sending before the drain starts
            (container,) = template["spec"]["containers"]
            assert container["lifecycle"]["preStop"]["sleep"]["seconds"] >= 5
        assert config.server.shutdown_grace_seconds >= 30  # long generations finish (grace: test_k8s.py)


def test_every_real_overlay_is_in_the_layout_table() -> None:
    assert set(REAL_OVERLAYS) <= set(LAYOUTS) and set(MODEL_PVC_OVERLAYS) <= set(REAL_OVERLAYS)
    assert sorted(p.name for p in (REPO_ROOT / "k8s" / "overlays").iterdir()) == sorted(LAYOUTS)
