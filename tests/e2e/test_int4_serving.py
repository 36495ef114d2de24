"""``tpserve serve`` on a 4-bit checkpoint at tp 2: a compressed-tensors ``pack-quantized`` W4A16 checkpoint
(asymmetric, group 32, written by the ``compressed-tensors`` library from a servable tiny Llama) is int4 by its
``config.json`` alone, and its greedy tokens, four prompts at once, are ``transformers``' on the library's
dequantization of it; so are a mixed-precision one's (llm-compressor's ``config_groups``: W4A16 MLPs with
``actorder: weight`` beside W8A16 attention, layer 0's down projection in ``ignore``, stored float and served
in float, as the start-up log says); and one written from the model in bfloat16, as releases are, whose
bfloat16 head is kept in its 16 bits (the log says so) with the float32 head's logits; a corrupt one (a NaN
scale) makes the server exit 1 at start-up naming the tensor.
(tests/worker/test_int4.py checks every format's tokens and logits at tp 1 and 2 through ``ModelRunner``.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.e2e.quantized_serving import reference_tokens, served_tokens
from tests.paths import STORIES_DIR, requires_stories
from tests.tiny_models import save_servable_model
from tests.worker.int4_checkpoints import save_compressed_tensors_groups, save_compressed_tensors_w4a16
from tests.worker.int8_checkpoints import save_cast

pytestmark = [pytest.mark.e2e, requires_stories]
#: Every linear weight but layer 0's down projection (which the mixed checkpoint's ``ignore`` keeps float).
BESIDE_IGNORED = re.compile(r"^(?!model\.layers\.0\.mlp\.down_proj).*_proj\.weight$")


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("int4_serving")
    source = save_servable_model("gqa_tied", root / "float", STORIES_DIR)
    return save_compressed_tensors_w4a16(source, root / "w4a16", root / "w4a16_dequantized", strategy="group",
                                         symmetric=False, group=32)


@pytest.fixture(scope="module")
def w4a16_bf16(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The W4A16 checkpoint written from the model in bfloat16, as releases are: its tied embedding and LM head
    (and norms) stored bfloat16."""
    root = tmp_path_factory.mktemp("int4_serving_bf16")
    source = save_cast(save_servable_model("gqa_tied", root / "float", STORIES_DIR), root / "bf16", torch.bfloat16)
    return save_compressed_tensors_w4a16(source, root / "w4a16", root / "w4a16_dequantized", strategy="group",
                                         symmetric=False, group=32)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mixed_serving")
    source = save_servable_model("gqa_tied", root / "float", STORIES_DIR)
    groups = {"mlp": (["re:.*mlp.*"], {"num_bits": 4, "symmetric": False, "strategy": "group", "group_size": 32,
                                        "actorder": "weight"}),
              "attention": (["re:.*self_attn.*"], {"num_bits": 8, "symmetric": True, "strategy": "channel"})}
    return save_compressed_tensors_groups(source, root / "mixed", root / "mixed_dequantized", groups,
                                          pattern=BESIDE_IGNORED, ignore=("model.layers.0.mlp.down_proj",))


@pytest.mark.parametrize("fixture", ["w4a16", "mixed", "w4a16_bf16"])
def test_a_w4a16_checkpoint_served_at_tp2_gives_transformers_tokens(fixture: str, request: pytest.FixtureRequest,
                                                                    tmp_path: Path) -> None:
    checkpoint, dequantized = request.getfixturevalue(fixture)
    log_path = tmp_path / "server.log"
    want_quantization = "int4+int8" if fixture == "mixed" else "int4"  # GetModelInfo: the codes' widths
    assert served_tokens(checkpoint, 2, log_path) == (reference_tokens(dequantized), want_quantization)
    if fixture == "mixed":
        log = log_path.read_text()
        assert "layers the checkpoint stores unquantized served in float" in log
        assert "model.layers.0.mlp.down_proj" in log
        assert "8-bit compressed-tensors weights (per output channel, symmetric) served as int8" in log
        assert "4-bit compressed-tensors weights (groups of 32, zero points) served as int4 codes as stored" in log
    if fixture == "w4a16_bf16":  # the head kept as stored, widened as it is read (worker/lm_head_w16.py)
        assert "LM head kept in bfloat16: its values on this rank are all bfloat16 values" in log_path.read_text()


def test_a_corrupt_int4_checkpoint_is_refused_at_start_up(w4a16: tuple[Path, Path], tmp_path: Path) -> None:
    import shutil

    checkpoint = Path(shutil.copytree(w4a16[0], tmp_path / "corrupt"))
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight_scale"][3, 1] = float("nan")
    save_file(tensors, checkpoint / "model.safetensors")
    done = subprocess.run([sys.executable, "-m", "launch.cli", "serve", "--model", str(checkpoint), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    (failed,) = [line for line in done.stderr.splitlines() if "start-up failed" in line]
    assert "model.layers.1.mlp.down_proj.weight_scale holds 1 zero or non-finite scales" in failed, failed
    assert "Traceback" not in done.stderr
