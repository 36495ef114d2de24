"""``--kv-transfer-config``: vLLM's JSON shape, its defaults and its one-line refusals."""

from __future__ import annotations

import json

import pytest

from tpserve.cli import build_parser, config_error, serve_config
from tpserve.config import ClusterConfig, RankConfig


def _config(*flags: str) -> ClusterConfig:
    return serve_config(build_parser().parse_args(["serve", *flags]))


def _error(*flags: str) -> str:
    with pytest.raises(ValueError) as info:
        _config(*flags)
    return config_error(info.value)


def test_vllms_json_with_its_defaults() -> None:
    kv = _config("--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}') \
        .kv_transfer.kv_transfer_config
    assert kv is not None
    assert (kv.kv_role, kv.is_consumer, kv.is_producer) == ("kv_consumer", True, False)
    assert (kv.side_channel_host, kv.side_channel_port, kv.transport) == ("127.0.0.1", 5600, "tcp")
    assert (kv.hold_timeout_s, kv.pull_timeout_s, kv.resolved_engine_id) == (30.0, 10.0, "tpserve-127.0.0.1-5600")
    assert (kv.max_hold_fraction, kv.max_hold_fraction_per_tenant) == (0.5, 0.25)
    assert _config().kv_transfer.kv_transfer_config is None  # off by default


def test_the_side_channel_and_timeouts_come_from_kv_connector_extra_config() -> None:
    text = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": "p0",
                       "kv_connector_extra_config": {"side_channel_host": "10.0.0.7", "side_channel_port": 6000,
                                                     "hold_timeout_s": 30, "pull_timeout_s": 2.5,
                                                     "max_hold_fraction": 0.75, "max_hold_fraction_per_tenant": 0.1}})
    config = _config("--kv-transfer-config", text, "--tensor-parallel-size", "2", "--cluster-secret-file", "/s")
    kv = config.kv_transfer.kv_transfer_config
    assert (kv.side_channel_host, kv.side_channel_port, kv.hold_timeout_s, kv.pull_timeout_s, kv.resolved_engine_id) \
        == ("10.0.0.7", 6000, 30.0, 2.5, "p0")
    assert kv.is_producer and kv.is_consumer and (kv.max_hold_fraction, kv.max_hold_fraction_per_tenant) == (0.75, 0.1)
    rank = RankConfig(cluster=config, model_dir="m", rank=1, world_size=2, local_rank=1, local_world_size=2,
                      address="unix:///x", init_method="file:///y")
    assert RankConfig.from_json(rank.to_json()).cluster.kv_transfer.kv_transfer_config == kv  # reaches the ranks


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "--kv-transfer-config: not JSON: Expecting property name"),
    ("[1]", "--kv-transfer-config: not a JSON object"),
    ('{"kv_connector": "MooncakeConnector"}', "kv_connector 'MooncakeConnector' is not served; use one of NixlConnector"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_decoder"}', "kv_role"),
    ('{"kv_connector": "NixlConnector", "kv_connector_extra_config": {"port": 1}}', "unknown keys ['port']"),
    ('{"kv_connector": "NixlConnector", "kv_connector_extra_config": {"side_channel_port": 0}}',
     "side_channel_port must be a port in [1, 65471], got 0"),
    ('{"kv_connector": "NixlConnector", "kv_connector_extra_config": {"pull_timeout_s": -1}}',
     "pull_timeout_s must be seconds in (0, 86400), got -1"),
    ('{"kv_connector": "NixlConnector", "kv_connector_extra_config": {"max_hold_fraction": 0}}',
     "max_hold_fraction must be a share of the KV pool in (0, 1], got 0"),
    ('{"kv_connector": "NixlConnector", "kv_connector_extra_config": {"max_hold_fraction_per_tenant": 1.5}}',
     "max_hold_fraction_per_tenant must be a share of the KV pool in (0, 1], got 1.5"),
    ('{"kv_connector": "NixlConnector", "kv_connector_extra_config": {"transport": "nixl"}}',
     "transport nixl needs the nixl package, which is not installed (pip install nixl), or use transport tcp"),
])
def test_bad_values_are_refused_in_one_line_naming_the_flag(text: str, message: str) -> None:
    error = _error("--kv-transfer-config", text)
    assert message in error and "\n" not in error and error.startswith("--kv-transfer-config")


@pytest.mark.parametrize(("flags", "needs"), [
    (("--pipeline-parallel-size", "2"), "--pipeline-parallel-size 1"),
    (("--no-enable-prefix-caching",), "--enable-prefix-caching"),
])
def test_what_a_transfer_cannot_carry_is_refused_at_start_up(flags: tuple[str, ...], needs: str) -> None:
    error = _error("--kv-transfer-config", '{"kv_connector": "NixlConnector"}', *flags)
    assert f"--kv-transfer-config needs {needs}" in error


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.7", "::", "pd-prefill.svc"])
def test_a_side_channel_beyond_loopback_needs_the_cluster_secret(host: str) -> None:
    """F2: without the secret nothing authenticates a peer's reads or the K/V it serves; refused, naming both."""
    text = json.dumps({"kv_connector": "NixlConnector", "kv_connector_extra_config": {"side_channel_host": host}})
    error = _error("--kv-transfer-config", text)
    assert error.startswith("--kv-transfer-config") and "\n" not in error
    assert f"side_channel_host {host} listens beyond loopback: give --cluster-secret-file" in error
    assert _config("--kv-transfer-config", text, "--cluster-secret-file", "/s").kv_transfer.kv_transfer_config
    for loopback in ("127.0.0.1", "::1", "localhost"):
        assert _config("--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_connector_extra_config":
                                                           {"side_channel_host": loopback}}))


def test_a_group_over_several_hosts_is_refused() -> None:
    error = _error("--kv-transfer-config", '{"kv_connector": "NixlConnector"}', "--nnodes", "2",
                   "--master-addr", "10.0.0.1", "--tensor-parallel-size", "2", "--cluster-secret-file", "/s")
    assert "--kv-transfer-config needs --nnodes 1" in error


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_an_8_bit_cache_is_carried(kv_cache_dtype: str) -> None:
    """Its scale pools move with the codes (worker/kv_transfer/blocks.py); no start-up refusal."""
    config = _config("--kv-transfer-config", '{"kv_connector": "NixlConnector"}', "--kv-cache-dtype", kv_cache_dtype)
    assert config.cache.kv_cache_dtype == kv_cache_dtype and config.kv_transfer.kv_transfer_config is not None
