"""Cluster config: defaults, YAML, flag overrides, and validation errors naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tpserve.cli import build_parser
from tpserve.config import ClusterConfig


def test_defaults_yaml_and_flags_in_order(tmp_path: Path) -> None:
    assert ClusterConfig().parallel.tensor_parallel_size == 1
    path = tmp_path / "cluster.yaml"
    path.write_text("parallel:\n  tensor_parallel_size: 4\ncache:\n  block_size: 32\n")
    config = ClusterConfig.load_from(path, {"parallel": {"tensor_parallel_size": 2}, "cache": {"block_size": None}})
    assert config.parallel.tensor_parallel_size == 2  # the flag wins
    assert config.cache.block_size == 32  # an unset flag leaves the YAML value


def test_invalid_values_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="tensor_parallel_size"):
        ClusterConfig.load_from(None, {"parallel": {"tensor_parallel_size": 0}})
    with pytest.raises(ValidationError, match="max_num_sequences"):
        ClusterConfig.load_from(None, {"scheduler": {"max_num_sequences": 3}})


def test_serve_flags_follow_vllm_names() -> None:
    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "2", "--max-num-seqs", "8",
                                      "--max-num-batched-tokens", "512", "--block-size", "8", "--max-model-len", "256",
                                      "--dtype", "bfloat16"])
    assert (args.tensor_parallel_size, args.max_num_seqs, args.max_num_batched_tokens, args.block_size,
            args.max_model_len, args.dtype) == (2, 8, 512, 8, 256, "bfloat16")
    from tpserve.cli import serve_config

    config = serve_config(build_parser().parse_args(["serve", "--speculative-method", "ngram",
                                                     "--num-speculative-tokens", "4", "--prompt-lookup-max", "3",
                                                     "--prompt-lookup-min", "2",
                                                     "--speculative-disable-by-batch-size", "8"]))
    assert config.speculative.speculative_method == "ngram" and config.speculative.num_speculative_tokens == 4
    assert config.speculative.lookup_range == (2, 3) and config.speculative.speculative_disable_by_batch_size == 8


def test_serve_names_a_bad_flag_in_one_line() -> None:
    """What `tpserve serve` prints for a bad flag (not through main(): it would configure logging globally)."""
    from tpserve.cli import _config_error, build_parser, serve_config

    for argv, message in ((["--ssl-certfile", "server.pem"], "--ssl-certfile and --ssl-keyfile go together"),
                          (["--max-num-seqs", "0"], "--max-num-seqs: Input should be greater than or equal to 1"),
                          (["--speculative-method", "ngram"],
                           "--speculative-method=ngram needs --num-speculative-tokens (>= 1)")):
        with pytest.raises(ValueError) as info:
            serve_config(build_parser().parse_args(["serve", *argv]))
        assert _config_error(info.value) == message


def test_cuda_graph_flags_reach_the_worker_command_line() -> None:
    from tpserve.cli import serve_config
    from tpserve.cluster import default_model_dir
    from tpserve.ranks import LocalRanks
    from tpserve.topology import GroupLayout
    from worker.main import parse_args

    config = serve_config(build_parser().parse_args(["serve", "--cuda-graph-sizes", "1", "4", "32"]))
    assert config.load.cuda_graph_sizes == (1, 4, 32) and not config.load.enforce_eager
    command = LocalRanks(config, default_model_dir(), GroupLayout(1, 1, 0), "json")._command(0, "unix:///x", "file:///y")
    worker_args = parse_args(command[3:])  # past `python -m worker.main`
    assert worker_args.cuda_graph_sizes == [1, 4, 32] and not worker_args.enforce_eager
    eager = serve_config(build_parser().parse_args(["serve", "--enforce-eager"]))
    command = LocalRanks(eager, default_model_dir(), GroupLayout(1, 1, 0), "json")._command(0, "unix:///x", "file:///y")
    assert parse_args(command[3:]).enforce_eager and "--cuda-graph-sizes" not in command
    with pytest.raises(ValidationError, match="cuda_graph_sizes"):
        ClusterConfig.load_from(None, {"load": {"cuda_graph_sizes": [0]}})
    with pytest.raises(ValidationError, match="cuda_graph_sizes"):
        ClusterConfig.load_from(None, {"load": {"cuda_graph_sizes": []}})
