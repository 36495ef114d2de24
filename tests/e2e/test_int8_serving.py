"""``tpserve serve --quantization int8`` at tp 2 on stories260k: the flag reaches every rank, and the output
is the int8 model's (tests/worker/test_int8.py states its agreement with the float goldens, measured there:
lines 2-5 all 64 tokens, line 1 its first 57), 16 requests at once, and every KV block is free afterwards."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.cluster import serve
from tests.e2e.stories import wait_all_blocks_free
from tests.paths import STORIES_DIR, load_goldens, requires_stories
from tests.worker.int8_goldens import GOLDEN_MIN_FULL_LINES, GOLDEN_MIN_PREFIX

pytestmark = [pytest.mark.e2e, requires_stories]


def test_int8_serving_at_tp2_agrees_with_the_goldens_sixteen_at_once(tmp_path: Path) -> None:
    goldens = load_goldens()
    batch = [goldens[i % len(goldens)] for i in range(16)]
    log_path = tmp_path / "server.log"
    with serve(STORIES_DIR, 2, "--quantization", "int8", "--log-format", "json", log_path=log_path) as cluster:
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda g: cluster.client.generate(g["prompt"], max_tokens=g["max_tokens"],
                                                                     temperature=0), batch))
        wait_all_blocks_free(cluster)
    loaded = [json.loads(line) for line in log_path.read_text().splitlines() if '"shard loaded"' in line]
    assert sorted(e["rank"] for e in loaded) == [0, 1] and {e["quantization"] for e in loaded} == {"int8"}
    # Each rank holds half the model: in float32 about 0.5 of the checkpoint's bytes; with int8 linear
    # layers and a float32 embedding (a seventh of stories260k's parameters) about 0.18.
    float32_bytes = sum(p.stat().st_size for p in STORIES_DIR.glob("*.safetensors"))
    assert all(e["weight_bytes"] < 0.25 * float32_bytes for e in loaded), (loaded, float32_bytes)
    prefixes = []
    for result, golden in zip(results, batch, strict=True):
        want = golden["completion_token_ids"]
        got = list(result.token_ids)
        agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        prefixes.append(agree)
    assert min(prefixes) >= GOLDEN_MIN_PREFIX, prefixes
    full = sum(p == len(g["completion_token_ids"]) for p, g in zip(prefixes[:5], goldens, strict=True))
    assert full >= GOLDEN_MIN_FULL_LINES, prefixes
    assert len(set(map(tuple, (r.token_ids for r in results[:5])))) == 5
    # The same prompt gives the same tokens in any slot of the batch.
    for i, result in enumerate(results):
        assert list(result.token_ids) == list(results[i % 5].token_ids)


def test_a_corrupt_int8_checkpoint_is_refused_at_start_up(tmp_path: Path) -> None:
    """Issue 20, item 7: a NaN weight_scale started and served all-<unk> tokens with NaN logprobs. Now the
    server exits 1 with one line per rank naming the tensor and the row, and no traceback."""
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    from tests.worker.int8_checkpoints import save_compressed_tensors

    checkpoint, _ = save_compressed_tensors(STORIES_DIR, tmp_path / "ct", tmp_path / "dequantized")
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.layers.2.mlp.down_proj.weight_scale"][5] = float("nan")
    save_file(tensors, checkpoint / "model.safetensors")
    done = subprocess.run([sys.executable, "-m", "launch.cli", "serve", "--model", str(checkpoint), "--port", "0"],
                          capture_output=True, text=True, timeout=60)  # before: it served, never exiting
    assert done.returncode == 1, done.stderr[-3000:]
    (failed,) = [line for line in done.stderr.splitlines() if "start-up failed" in line]
    assert "weight 'model.layers.2.mlp.down_proj.weight_scale': weight_scale of output row 5 is nan" in failed
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) < 10
