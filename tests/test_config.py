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


@pytest.mark.parametrize("endpoint", ["http://otel-collector:4317", "https://otel.example.com:443", "grpc://localhost:4317",
                                      "localhost:4317", "HTTP://10.0.0.7:4317/", "[::1]:4317", "http://[::1]:4317", ""])
def test_otlp_traces_endpoint_takes_what_the_exporter_dials(endpoint: str) -> None:
    server = ClusterConfig.load_from(None, {"server": {"otlp_traces_endpoint": endpoint}}).server
    assert server.otlp_traces_endpoint == endpoint


@pytest.mark.parametrize("endpoint, refused", [
    ("http://127.0.0.1:99999", "needs a port in 1-65535"), ("http://x:0", "needs a port in 1-65535"),
    ("x:port", "needs a port in 1-65535"), ("ftp://x:1", "is not OTLP over gRPC (scheme ftp)"),
    ("unix:///tmp/otel.sock", "is not OTLP over gRPC (scheme unix)"), ("notaurl", "is not a collector's address"),
    ("http://otel-collector", "is not a collector's address"), ("http://:4317", "is not a collector's address"),
    ("http://user:secret@x:4317", "is not a collector's address"), ("x:4317/v1/traces", "is not a collector's address"),
])
def test_otlp_traces_endpoint_refuses_what_the_exporter_cannot_dial(endpoint: str, refused: str) -> None:
    """Each of these started a server whose exporter failed only after the first request, in its retry warnings."""
    with pytest.raises(ValidationError, match="otlp_traces_endpoint") as info:
        ClusterConfig.load_from(None, {"server": {"otlp_traces_endpoint": endpoint}})
    assert f"{endpoint} {refused}" in str(info.value)


TWO_HOSTS = ["--nnodes", "2", "--tensor-parallel-size", "2", "--master-addr", "10.0.0.7", "--master-port", "29500"]
KV = ["--tensor-parallel-size", "2", "--kv-transfer-config", '{"kv_connector": "NixlConnector"}']  # ports 5600, 5601


@pytest.mark.parametrize("argv, message", [
    (["--port", "53060", "--metrics-port", "53060"], "--metrics-port 53060 is also --port; choose another --metrics-port"),
    (["--port", "53060", "--health-port", "53061", "--metrics-port", "53061"],
     "--metrics-port 53061 is also --health-port; choose another --metrics-port"),
    (["--health-port", "50051"], "--health-port 50051 is also --port; choose another --health-port"),
    (["--port", "29500", *TWO_HOSTS], "--master-port 29500 is also --port; choose another --master-port"),
    (["--metrics-port", "29501", *TWO_HOSTS],
     "--master-port 29500 + 1 (the rendezvous store) is also --metrics-port; choose another --master-port"),
    (["--port", "5601", *KV], "--kv-transfer-config's side_channel_port 5600 + 1 (rank 1's KV side channel) is also "
                              "--port; choose another side_channel_port"),
])
def test_two_of_the_leaders_ports_on_one_number_name_both_flags(argv: list[str], message: str) -> None:
    """Refused with the configuration, before anything binds: the second bind blamed "another process"."""
    from tpserve.cli import config_error, serve_config

    with pytest.raises(ValueError) as info:
        serve_config(build_parser().parse_args(["serve", *argv]))
    assert config_error(info.value) == message


@pytest.mark.parametrize("argv", [
    ["--port", "0", "--metrics-port", "0", "--health-port", "0"],  # each a port the system chooses
    ["--port", "29500", "--metrics-port", "29501"],  # one host: no registry, no store (a rendezvous file)
    ["--port", "29502", *TWO_HOSTS],  # the ranks' ports, master + 2 + r, are the headless nodes'
    ["--port", "29501", "--nnodes", "2", "--tensor-parallel-size", "2", "--node-rank", "1", "--headless",
     "--master-addr", "10.0.0.7"],  # a headless node binds neither --port nor the store
])
def test_ports_that_do_not_clash(argv: list[str]) -> None:
    from tpserve.cli import serve_config

    serve_config(build_parser().parse_args(["serve", *argv]))


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
    # Async scheduling: on for CUDA ranks and for CPU ranks that leave the coordinator a core (not with a
    # proposer or pipeline stages), or as the flag says.
    assert config.scheduler.async_scheduling is None and not config.async_scheduling_on("cuda")  # ngram above
    assert not config.async_scheduling_on("cpu", spare_core=True)
    plain = serve_config(build_parser().parse_args(["serve"]))
    assert plain.async_scheduling_on("cuda") and not plain.async_scheduling_on("cpu")
    assert plain.async_scheduling_on("cpu", spare_core=True)
    piped = serve_config(build_parser().parse_args(["serve", "--pipeline-parallel-size", "2"]))
    assert not piped.async_scheduling_on("cuda") and not piped.async_scheduling_on("cpu", spare_core=True)
    assert serve_config(build_parser().parse_args(["serve", "--async-scheduling"])).async_scheduling_on("cpu")
    off = serve_config(build_parser().parse_args(["serve", "--no-async-scheduling"]))
    assert not off.async_scheduling_on("cuda") and not off.async_scheduling_on("cpu", spare_core=True)
    # Multi-step scheduling turns the default's async scheduling off (a plan of several steps is one of each).
    steps = serve_config(build_parser().parse_args(["serve", "--num-scheduler-steps", "8"]))
    assert steps.scheduler.num_scheduler_steps == 8 and plain.scheduler.num_scheduler_steps == 1
    assert not steps.async_scheduling_on("cuda") and not steps.async_scheduling_on("cpu", spare_core=True)


def test_the_coordinator_has_a_core_when_its_hosts_ranks_leave_one() -> None:
    from launch.leader import coordinator_has_a_core

    assert coordinator_has_a_core({0: 1}, range(1), cores=2)  # tp 1, OMP_NUM_THREADS=1 on 2 cores
    assert not coordinator_has_a_core({0: 2}, range(1), cores=2)  # the default split: every core
    assert not coordinator_has_a_core({0: 1, 1: 1}, range(2), cores=2)  # tp 2, a thread each
    assert coordinator_has_a_core({0: 3, 1: 3}, range(2), cores=8)
    # Two hosts of two ranks: only this host's ranks (0 and 1) share its cores.
    assert coordinator_has_a_core({0: 1, 1: 1, 2: 4, 3: 4}, range(2), cores=4)
    assert not coordinator_has_a_core({0: 2, 1: 2, 2: 1, 3: 1}, range(2), cores=4)


def test_serve_names_a_bad_flag_in_one_line() -> None:
    """What `tpserve serve` prints for a bad flag (not through main(): it would configure logging globally)."""
    from tpserve.cli import config_error, build_parser, serve_config

    for argv, message in ((["--ssl-certfile", "server.pem"], "--ssl-certfile and --ssl-keyfile go together"),
                          (["--max-num-seqs", "0"], "--max-num-seqs: Input should be greater than or equal to 1"),
                          (["--speculative-method", "ngram"],
                           "--speculative-method=ngram needs --num-speculative-tokens (>= 1)"),
                          (["--async-scheduling", "--speculative-method", "ngram", "--num-speculative-tokens", "2"],
                           "--async-scheduling does not combine with --speculative-method (a proposal needs the "
                           "tokens before it)"),
                          (["--async-scheduling", "--pipeline-parallel-size", "2"],
                           "--async-scheduling needs --pipeline-parallel-size 1 (micro-batches already keep every "
                           "stage busy)"),
                          (["--num-scheduler-steps", "0"],
                           "--num-scheduler-steps: Input should be greater than or equal to 1"),
                          (["--num-scheduler-steps", "4", "--pipeline-parallel-size", "2"],
                           "--num-scheduler-steps 4 does not combine with --pipeline-parallel-size > 1 (a plan of "
                           "several steps feeds each rank's own samples on one stage, and the last stage samples "
                           "what the first one needs)"),
                          (["--num-scheduler-steps", "4", "--async-scheduling"],
                           "--num-scheduler-steps 4 does not combine with --async-scheduling (both run the ranks "
                           "ahead of the coordinator: a plan of several steps on the ranks, async scheduling by "
                           "planning a step before the last one's result; the scheduler does one or the other)"),
                          (["--num-scheduler-steps", "2", "--speculative-method", "ngram",
                            "--num-speculative-tokens", "2"],
                           "--num-scheduler-steps 2 does not combine with --speculative-method (a plan of several "
                           "steps feeds each step the one token sampled before it, without proposals)")):
        with pytest.raises(ValueError) as info:
            serve_config(build_parser().parse_args(["serve", *argv]))
        assert config_error(info.value) == message


def test_worker_settings_reach_the_rank_in_one_hop(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Flags -> ClusterConfig -> the rank's RankConfig file (JSON, as the launcher writes it) -> the rank's
    WorkerOptions: one serialised, validated object, read back by the rank with the same models."""
    from launch.local_ranks import LocalRanks
    from tpserve.cli import serve_config
    from tpserve.config import RankConfig
    from tpserve.embedded_model import default_model_dir
    from launch.topology import GroupLayout
    from worker.main import read_config, worker_options

    config = serve_config(build_parser().parse_args([
        "serve", "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1", "--headless",
        "--master-addr", "10.0.0.7", "--cuda-graph-sizes", "1", "4", "32", "--kv-cache-memory-bytes", "1000000",
        "--max-model-len", "128", "--max-num-seqs", "8", "--distributed-timeout-seconds", "7", "--dtype", "bfloat16"]))
    assert config.load.cuda_graph_sizes == (1, 4, 32) and not config.load.enforce_eager
    ranks = LocalRanks(config, default_model_dir(), GroupLayout(4, 2, 1), "json")
    path = tmp_path / "rank3.json"
    path.write_text(ranks.rank_config(3, "tcp://10.0.0.8:29503", "tcp://10.0.0.7:29501").to_json())
    options = worker_options(read_config(["--config", str(path)]))
    assert (options.rank, options.world_size, options.local_rank, options.local_world_size, options.node_rank) == \
        (3, 4, 1, 2, 1)
    assert (options.tensor_parallel_size, options.pipeline_parallel_size) == (4, 1)
    assert options.model_dir == str(default_model_dir()) and options.init_method == "tcp://10.0.0.7:29501"
    assert options.cuda_graph_sizes == (1, 4, 32) and not options.enforce_eager and options.dtype == "bfloat16"
    assert options.distributed_timeout_seconds == 7.0 and options.cache.kv_cache_memory_bytes == 1_000_000
    assert options.cache.max_model_len == 128 and options.cache.max_num_seqs == 8
    eager = serve_config(build_parser().parse_args(["serve", "--enforce-eager"]))
    sent = LocalRanks(eager, default_model_dir(), GroupLayout(1, 1, 0), "json").rank_config(0, "unix:///x", "file:///y")
    options = worker_options(RankConfig.from_json(sent.to_json()))
    assert options.enforce_eager and options.cuda_graph_sizes is None
    # The lone rank's config that worker/main.py's docstring shows for debugging by hand is valid.
    import worker.main

    doc = worker.main.__doc__
    by_hand = RankConfig.from_json(doc[doc.index('{"model_dir"'):doc.index("}", doc.index('{"model_dir"')) + 1])
    assert by_hand.cluster == ClusterConfig() and worker_options(by_hand).world_size == 1
    # A config the rank cannot use is refused by the rank, naming the field (argparse: exit 2).
    path.write_text(path.read_text().replace('"rank": 3', '"rank": 4'))
    with pytest.raises(SystemExit) as exit_info:
        read_config(["--config", str(path)])
    assert exit_info.value.code == 2 and "rank=4 must be < world_size=4" in capsys.readouterr().err
    with pytest.raises(ValidationError, match="cuda_graph_sizes"):
        ClusterConfig.load_from(None, {"load": {"cuda_graph_sizes": [0]}})
    with pytest.raises(ValidationError, match="cuda_graph_sizes"):
        ClusterConfig.load_from(None, {"load": {"cuda_graph_sizes": []}})


def test_the_rank_gets_the_tensor_parallel_size_as_itself() -> None:
    """Issue 42: the tp degree reaches the worker as ``tensor_parallel_size`` (not re-derived from the
    group's size), ``world_size`` is tp x pp everywhere, and a RankConfig whose ``world_size`` is not
    the cluster's tp x pp is refused."""
    from launch.local_ranks import LocalRanks
    from launch.topology import GroupLayout
    from tpserve.cli import serve_config
    from tpserve.config import RankConfig
    from tpserve.embedded_model import default_model_dir
    from worker.main import worker_options

    config = serve_config(build_parser().parse_args([
        "serve", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]))
    assert config.parallel.world_size == 4
    ranks = LocalRanks(config, default_model_dir(), GroupLayout(config.parallel.world_size), "json")
    sent = RankConfig.from_json(ranks.rank_config(3, "unix:///x", "file:///y").to_json())
    options = worker_options(sent)
    assert (sent.rank, sent.world_size) == (3, 4)
    assert (options.tensor_parallel_size, options.pipeline_parallel_size, options.world_size) == (2, 2, 4)
    with pytest.raises(ValidationError, match="world_size=2 must be tensor_parallel_size=2 x pipeline_parallel_size=2 = 4"):
        RankConfig(cluster=config, model_dir="/m", rank=0, world_size=2, local_rank=0, local_world_size=1,
                   address="unix:///x", init_method="file:///y")


def test_kv_cache_dtype_choices() -> None:
    """``--kv-cache-dtype`` (vLLM's choices) reaches the rank, with a draft model too; another value is refused."""
    from launch.local_ranks import LocalRanks
    from launch.topology import GroupLayout
    from tpserve.cli import serve_config
    from tpserve.config import RankConfig
    from tpserve.embedded_model import default_model_dir
    from worker.main import worker_options

    assert ClusterConfig().cache.kv_cache_dtype == "auto"
    config = serve_config(build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"]))
    sent = LocalRanks(config, default_model_dir(), GroupLayout(1, 1, 0), "json").rank_config(0, "unix:///x", "file:///y")
    assert worker_options(RankConfig.from_json(sent.to_json())).kv_cache_dtype == "fp8"
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        ClusterConfig.load_from(None, {"cache": {"kv_cache_dtype": "fp16"}})
    drafted = ClusterConfig.load_from(None, {"cache": {"kv_cache_dtype": "int8"},
                                             "speculative": {"speculative_method": "draft", "speculative_model": "d",
                                                             "num_speculative_tokens": 2}})
    assert (drafted.cache.kv_cache_dtype, drafted.speculative.speculative_method) == ("int8", "draft")


def test_the_ranks_config_file_holds_no_api_key() -> None:
    """The ranks never check tenants' or operators' keys, and their JSON file outlives a coordinator killed
    with SIGKILL: the keys stay out of it (the key files' paths may stay: a path is no secret)."""
    from launch.local_ranks import LocalRanks
    from launch.topology import GroupLayout
    from tpserve.cli import serve_config
    from tpserve.config import RankConfig
    from tpserve.embedded_model import default_model_dir

    config = serve_config(build_parser().parse_args(["serve", "--api-key", "TENANT-SECRET-1",
                                                     "--operator-api-key", "OPERATOR-SECRET-2"]))
    assert config.server.api_key == "TENANT-SECRET-1" and config.server.operator_api_key == "OPERATOR-SECRET-2"
    text = LocalRanks(config, default_model_dir(), GroupLayout(1), "json").rank_config(0, "unix:///x",
                                                                                     "file:///y").to_json()
    assert "SECRET" not in text
    sent = RankConfig.from_json(text)  # still valid for the rank
    assert sent.cluster.server.api_key is None and sent.cluster.server.operator_api_key is None
    assert sent.cluster.server.port == config.server.port
