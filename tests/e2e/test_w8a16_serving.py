"""``tpserve serve`` on published 8-bit weight-only checkpoints, at tp 1 and 2: GPTQ ``bits: 8`` (symmetric,
group 32, ``checkpoint_format: gptq``: byte codes with group-wise scales on the w8 kernel) and compressed-tensors
``pack-quantized`` W8A16 (symmetric, channel-wise, written by the ``compressed-tensors`` library: int8 per
channel on the int8 kernel), each served by its ``config.json`` alone, from a servable tiny Llama. Greedy
tokens, four prompts at once, are ``transformers``' on the format's reference dequantization; a corrupt one
(act-order GPTQ without a ``g_idx``) makes the server exit 1 at start-up naming the tensor.
(tests/worker/test_w8a16.py checks six layouts' tokens and logits at tp 1 and 2 through ``ModelRunner``.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.e2e.quantized_serving import reference_tokens, served_tokens
from tests.paths import STORIES_DIR, requires_stories
from tests.tiny_models import save_servable_model
from tests.worker.w8a16_checkpoints import save_compressed_tensors_w8a16, save_gptq8

pytestmark = [pytest.mark.e2e, requires_stories]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("w8a16_serving")
    source = save_servable_model("gqa_tied", root / "float", STORIES_DIR)
    return {"gptq8": save_gptq8(source, root / "gptq8", root / "gptq8_dequantized", group=32, sym=True),
            "w8a16": save_compressed_tensors_w8a16(source, root / "w8a16", root / "w8a16_dequantized",
                                                   strategy="channel", symmetric=True)}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["gptq8", "w8a16"])
def test_an_8_bit_checkpoint_served_gives_transformers_tokens(checkpoints: dict[str, tuple[Path, Path]], name: str,
                                                              tp: int) -> None:
    checkpoint, dequantized = checkpoints[name]
    # 8-bit codes, reported as such (the loaders' layer kind for packed codes is "int4")
    assert served_tokens(checkpoint, tp) == (reference_tokens(dequantized), "int8")


def test_act_order_8_bit_gptq_without_g_idx_is_refused_at_start_up(checkpoints: dict[str, tuple[Path, Path]],
                                                                   tmp_path: Path) -> None:
    checkpoint = Path(shutil.copytree(checkpoints["gptq8"][0], tmp_path / "corrupt"))
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.g_idx"]
    save_file(tensors, checkpoint / "model.safetensors")
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (checkpoint / "config.json").write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-m", "launch.cli", "serve", "--model", str(checkpoint), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    (failed,) = [line for line in done.stderr.splitlines() if "start-up failed" in line]
    assert "missing ['model.layers.1.mlp.down_proj.g_idx'] (gptq desc_act" in failed, failed
    assert "Traceback" not in done.stderr
