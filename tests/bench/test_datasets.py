"""Workloads: random token-id prompts (vLLM's length rule) and JSONL files."""

from __future__ import annotations

import json

import pytest

from tpserve.bench.datasets import jsonl_requests, length_range, load_jsonl, random_requests


def test_length_range_follows_vllm() -> None:
    assert length_range(128, 0.0) == (128, 128)
    assert length_range(100, 0.25) == (75, 125)
    assert length_range(3, 0.9) == (1, 6)  # never below one token
    for length, ratio in ((0, 0.0), (10, 1.0), (10, -0.1)):
        with pytest.raises(ValueError):
            length_range(length, ratio)


def test_random_requests_are_seeded_and_in_range() -> None:
    requests = random_requests(300, seed=5, vocab_size=40, input_len=20, output_len=10, range_ratio=0.5,
                               excluded_ids=[2, 3])
    assert requests == random_requests(300, 5, 40, 20, 10, 0.5, [2, 3])
    assert requests != random_requests(300, 6, 40, 20, 10, 0.5, [2, 3])
    prompt_lens = {len(r.prompt) for r in requests}
    assert min(prompt_lens) == 10 and max(prompt_lens) == 30
    assert {r.max_tokens for r in requests} == set(range(5, 16))
    ids = {token for r in requests for token in r.prompt}
    assert ids == set(range(40)) - {2, 3}


def test_jsonl_requests(tmp_path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "Once upon a time", "max_tokens": 7}) + "\n\n"
                    + json.dumps({"prompt": [5, 6, 7]}) + "\n")
    rows = load_jsonl(path, default_max_tokens=32)
    assert [(r.prompt, r.max_tokens) for r in rows] == [("Once upon a time", 7), ([5, 6, 7], 32)]
    assert [r.prompt for r in jsonl_requests(path, 5, 32)] == ["Once upon a time", [5, 6, 7]] * 2 + [
        "Once upon a time"]


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ('{"prompt": ""}', "prompt"),
    ('{"prompt": [1, "a"]}', "prompt"),
    ('{"max_tokens": 3}', "prompt"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    ('{"prompt": "x", "max_tokens": 2.5}', "max_tokens"),
])
def test_bad_jsonl_line_is_named(tmp_path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{message}"):
        load_jsonl(path, 16)
