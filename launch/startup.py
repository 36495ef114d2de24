"""What a node checks and resolves before it starts any process, on the leader and on a headless node alike.

Both refuse a model that cannot be split at the asked ``--tensor-parallel-size`` and read the
group's secret; both name the model to the node registry by the SHA-256 of its config.json.
No coordinator and no torch here: a headless node imports this module.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Iterable
from pathlib import Path

import grpc

from tpserve.checkpoint import check_head_weights, checkpoint_files
from tpserve.cluster_secret import read_secret
from tpserve.config import ClusterConfig
from tpserve.kv_transfer_config import side_channel_bind_error
from tpserve.embedded_model import default_model_dir
from tpserve.expert_parallel import check_expert_parallel
from tpserve.model_config import ModelConfig
from tpserve.pipeline_split import stage_layer_counts
from tpserve.model_registry import FLOAT_EXPERTS_ARCHITECTURES, FLOAT_ONLY_ARCHITECTURES
from tpserve.quantization import check_quantization_flag, checkpoint_quantization, served_quantization


class StartupError(RuntimeError):
    """The node cannot start with this configuration or model; the message says why."""


def model_dir_of(config: ClusterConfig) -> Path:
    """``--model``'s directory, or the embedded model's without one."""
    return Path(config.load.model) if config.load.model else default_model_dir()


def read_group_secret(config: ClusterConfig) -> str | None:
    """The group's cluster secret (``--cluster-secret-file``), or None.

    Raises:
        StartupError: the file cannot be read or holds too short a secret.
    """
    path = config.parallel.cluster_secret_file
    if path is None:
        return None
    try:
        return read_secret(path)
    except (OSError, ValueError) as exc:
        raise StartupError(f"--cluster-secret-file: {exc}") from exc


def read_model_config(model_dir: Path, tensor_parallel_size: int, pipeline_parallel_size: int = 1,
                      enable_expert_parallel: bool = False, *, draft: bool = False,
                      quantization: str | None = None) -> ModelConfig:
    """The checkpoint's config, checked to split at ``tensor_parallel_size`` and into ``pipeline_parallel_size`` stages.

    With ``enable_expert_parallel`` also checked to split its experts whole over the
    tensor-parallel group (tpserve/expert_parallel.py); a ``draft`` model (``--speculative-model``, which
    the messages then name instead of ``--model``) may be dense. A
    ``quantization`` (``--quantization``) that does not apply to the checkpoint is refused
    (:func:`tpserve.quantization.check_quantization_flag`).

    Raises:
        StartupError: not a checkpoint directory, an unsupported architecture or
            quantization_config, a config value out of its range, an untied model without
            ``lm_head.weight``, or the model cannot be split.
    """
    flag = "--speculative-model" if draft else "--model"  # the flag that named the directory, for the user to fix
    if not model_dir.exists():
        raise StartupError(f"{flag} {model_dir}: no such directory (give a Hugging Face checkpoint directory)")
    if not model_dir.is_dir():
        raise StartupError(f"{flag} {model_dir}: not a directory (give a Hugging Face checkpoint directory)")
    if not (model_dir / "config.json").is_file():
        raise StartupError(f"{flag} {model_dir}: not a Hugging Face checkpoint directory (no config.json)")
    try:
        config = ModelConfig.from_pretrained(model_dir)  # also refuses an unsupported quantization_config
        check_checkpoint(model_dir, config)
    except ValueError as exc:
        raise StartupError(f"cannot serve {model_dir}: {exc}") from exc
    try:
        config.check_tensor_parallel(tensor_parallel_size)
    except ValueError as exc:
        raise StartupError(f"cannot serve {model_dir} at --tensor-parallel-size {tensor_parallel_size}: {exc}") from exc
    try:
        stage_layer_counts(config.num_hidden_layers, pipeline_parallel_size)
    except ValueError as exc:
        raise StartupError(f"cannot serve {model_dir} at --pipeline-parallel-size {pipeline_parallel_size}: {exc}") from exc
    if enable_expert_parallel:
        try:
            check_expert_parallel(config, tensor_parallel_size, require_experts=not draft)
        except ValueError as exc:
            raise StartupError(f"cannot serve {model_dir} with --enable-expert-parallel: {exc}") from exc
    try:
        check_quantization_flag(config.hf_config, quantization)
    except ValueError as exc:
        raise StartupError(f"cannot serve {model_dir}: {exc}") from exc
    served = served_quantization(config.hf_config, quantization)
    if config.architecture in FLOAT_ONLY_ARCHITECTURES and served:  # before any rank builds the model
        how = f"--quantization {quantization}" if quantization else f"its {served} linear layers as stored"
        raise StartupError(f"cannot serve {model_dir} with {how}: {config.architecture}'s Mamba-2 and expert "
                           "weights load float only; serve a float checkpoint without --quantization")
    layout = FLOAT_EXPERTS_ARCHITECTURES.get(config.architecture)
    if layout is not None and served not in ("", "fp8"):  # the experts' own refusal, before any rank starts
        how = f"--quantization {quantization}" if quantization else f"its {served} linear layers as stored"
        raise StartupError(f"cannot serve {model_dir} with {how}: its experts are {layout}, which load float only "
                           "(a checkpoint layout that int8 and int4 weights do not fill); serve its float (or "
                           "gpt-oss's MXFP4) checkpoint without --quantization")
    if config.latent_attention and checkpoint_quantization(config.hf_config):  # before any rank loads it
        raise StartupError(
            f"cannot serve {model_dir}: its linear layers are stored {served_quantization(config.hf_config, None)}, "
            f"and multi-head latent attention's projections ({config.architecture}) load float only (a float or "
            "FP8 checkpoint serves, with --quantization int8 or int4 for its MLP and experts)")
    return config


def check_hybrid_combinations(model_dir: Path, model: ModelConfig, config: ClusterConfig) -> None:
    """Refuse, in one line each, what a hybrid model's state layers (tpserve/hybrid_layers.py) are not served with:
    speculative decoding (a state cannot roll back rejected tokens), LoRA adapters (none targets a state layer's
    projections yet), pipeline stages (the state pool is not split by stage), and the host tier and KV transfers
    (a prefix's KV blocks resume nothing without its saved state, which neither carries).

    Raises:
        StartupError: naming the flag.
    """
    if not model.state_layer_indices:
        return
    what = f"{model.architecture} is a hybrid model (state layers beside attention layers)"
    spec = config.speculative.speculative_method
    if spec is not None:
        raise StartupError(f"cannot serve {model_dir} with --speculative-method {spec}: {what}, whose state layers "
                           "cannot roll back rejected tokens")
    if config.lora.enable_lora:
        raise StartupError(f"cannot serve {model_dir} with --enable-lora: {what}, and adapters are not served on "
                           "its state layers' projections")
    if config.parallel.pipeline_parallel_size > 1:
        raise StartupError(f"cannot serve {model_dir} with --pipeline-parallel-size "
                           f"{config.parallel.pipeline_parallel_size}: {what}, served as one pipeline stage")
    moves = [flag for flag, on in (("--kv-offloading-size / --num-cpu-blocks-override", config.cache.host_tier_on),
                                   ("--kv-transfer-config", config.kv_transfer.kv_transfer_config is not None)) if on]
    if moves:
        raise StartupError(f"cannot serve {model_dir} with {moves[0]}: {what}, and its KV blocks resume nothing "
                           "without the saved state, which the host tier and KV transfers do not carry")


def check_checkpoint(model_dir: Path, config: ModelConfig) -> None:
    """Refuse a checkpoint that lacks a weight the config implies (an untied model's ``lm_head.weight``),
    from the files' headers only, before any rank starts: each rank's loader would refuse it too, but
    a rank's failure ends the server with exit code 1 and a log line, not this one line and code 2.
    A directory without safetensors files is left to the ranks' loader, which names what is missing.

    Raises:
        ValueError: naming the missing weight.
    """
    try:
        names = checkpoint_files(model_dir)
    except FileNotFoundError:
        return
    check_head_weights(config, names)


def draft_config_sha256(config: ClusterConfig) -> str:
    """SHA-256 (hex) of the draft model's config.json, or "" without ``--speculative-model``."""
    draft = config.speculative.speculative_model
    return "" if draft is None else config_sha256(Path(draft))


def config_sha256(model_dir: Path) -> str:
    """SHA-256 (hex) of a checkpoint's config.json: how the nodes of a group check they serve the same model."""
    return hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()


def bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """The bound port, or 0 where ``address`` cannot be bound (grpc raises or returns 0, by version)."""
    try:
        if credentials is not None:
            return server.add_secure_port(address, credentials)
        return server.add_insecure_port(address)
    except RuntimeError:
        return 0


def check_kv_side_channel(config: ClusterConfig, ranks: Iterable[int]) -> None:
    """Refuses, in one line naming the field and the address, a KV side channel (``--kv-transfer-config``)
    that this host's ``ranks`` could not bind: an address not on this machine, or a port another process
    holds (one of this server's own ports is refused with the configuration: tpserve/leader_ports.py).
    Checked before the ranks start, so that the failure is not a rank's traceback followed by "worker
    group lost"; a port taken in between still fails the rank (worker/main.py says so in one line too).

    Raises:
        StartupError: naming ``kv_connector_extra_config.side_channel_host`` or ``side_channel_port``.
    """
    kv = config.kv_transfer.kv_transfer_config
    if kv is None:
        return
    for rank in ranks:
        address = (kv.side_channel_host, kv.side_channel_port + rank)
        try:
            socket.create_server(address, reuse_port=False).close()
        except OSError as exc:
            raise StartupError(side_channel_bind_error(kv.side_channel_host, kv.side_channel_port, rank, exc)) from None

