"""``tpserve serve --enable-expert-parallel``: whole experts per rank, served end to end.

Qwen2-MoE's tiny checkpoint (experts and a tensor-parallel shared expert, one dense and one
MoE layer; tests/worker/test_qwen2_moe.py) at stories260k's vocabulary and tokenizer
(tests/tiny_models.py's servable copy), served by the real server at
tensor-parallel degree 2 with the flag: four prompts at once give ``transformers``' 40
greedy tokens each, both ranks log that they hold whole experts, and GetModelInfo reports
the flag. The refusals a user meets (a dense model, experts that do not divide) are each
one line and exit code 2, before any rank starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.cluster import free_port, serve
from tests.paths import REPO_ROOT, STORIES_DIR, requires_stories
from tests.tiny_models import load_hf_model, save_servable_model
from tests.worker.moe_specs import QWEN2_MOE_SPEC
from tpserve.embedded_model import default_model_dir

pytestmark = [pytest.mark.e2e, requires_stories]

MAX_TOKENS = 40
PROMPTS = ("Once upon a time", "The little dog", "She went to the park and", "Tom had a red ball")


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_servable_model(QWEN2_MOE_SPEC, tmp_path_factory.mktemp("ep") / "qwen2_moe", STORIES_DIR)


def _greedy(model_dir: Path, prompt_ids: list[int]) -> list[int]:
    import torch

    model = load_hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def test_serve_with_expert_parallel_gives_transformers_greedy_tokens(qwen2_moe: Path, tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(qwen2_moe / "tokenizer.json"))
    log_path = tmp_path / "server.log"
    with serve(qwen2_moe, 2, "--enable-expert-parallel", "--log-format", "json", log_path=log_path) as cluster:
        assert cluster.client.model_info().enable_expert_parallel is True
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: cluster.client.generate(p, max_tokens=MAX_TOKENS, temperature=0,
                                                                      ignore_eos=True), PROMPTS))
    for prompt, result in zip(PROMPTS, results, strict=True):
        prompt_ids = tokenizer(prompt)["input_ids"]
        assert list(result.token_ids) == _greedy(qwen2_moe, prompt_ids), prompt
    loaded = [json.loads(line) for line in log_path.read_text().splitlines() if '"shard loaded"' in line]
    assert sorted(e["rank"] for e in loaded) == [0, 1]
    assert all(e["enable_expert_parallel"] is True and e["tp_size"] == 2 for e in loaded), loaded


def _copy_with(model_dir: Path, into: Path, **changes: object) -> Path:
    """``model_dir``'s files linked into ``into``, its config.json changed by ``changes``."""
    into.mkdir()
    for path in model_dir.iterdir():
        if path.name != "config.json":
            (into / path.name).symlink_to(path)
    config = json.loads((model_dir / "config.json").read_text())
    (into / "config.json").write_text(json.dumps({**config, **changes}))
    return into


def test_unservable_combinations_are_refused_in_one_line(qwen2_moe: Path, tmp_path: Path) -> None:
    six_experts = _copy_with(qwen2_moe, tmp_path / "six", num_experts=6)
    cases = [
        (default_model_dir(), ["--tensor-parallel-size", "2"],
         "--enable-expert-parallel needs a mixture-of-experts model; LlamaForCausalLM has no routed experts"),
        (six_experts, ["--tensor-parallel-size", "4"],
         "num_experts=6 is not divisible by --tensor-parallel-size=4 (each rank holds"),
    ]
    for model, flags, named in cases:
        out = subprocess.run([sys.executable, "-m", "launch.cli", "serve", "--model", str(model), *flags,
                              "--enable-expert-parallel", "--port", str(free_port())],
                             capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        assert out.returncode == 2, out.stderr[-2000:]
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
        assert lines[0].startswith(f"tpserve serve: cannot serve {model} with --enable-expert-parallel: "), lines[0]
        assert named in lines[0], lines[0]
