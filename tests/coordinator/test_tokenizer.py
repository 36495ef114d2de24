"""Tokenizer: the stories260k tokenizer against the goldens and transformers, and the config rules.

Variants (no post-processor, no tokenizer_config.json, eos lists) are written to
``tmp_path`` from the shared tokenizer.json; nothing is copied into the repository.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.tokenizer import Tokenizer
from tests.paths import REPO_ROOT, STORIES_DIR, load_goldens, requires_stories

pytestmark = requires_stories

BOS, EOS = 1, 2
FAMILY = "👨\u200d👩\u200d👧\u200d👦"  # a ZWJ sequence: 4 emoji joined by U+200D
UNICODE_TEXTS = ["café ñandú über", "日本語 and 中文", f"hi 🙂👍🏽 and {FAMILY}!", "  two spaces\nnew line"]


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip(
        "transformers", reason="transformers is a test dependency (pip install -e '.[test]')")
    return transformers.AutoTokenizer.from_pretrained(STORIES_DIR)


def make_model_dir(tmp_path: Path, *, tokenizer_config: dict | None, post_processor: bool = True,
                   config: dict | None = None, generation_config: dict | None = None) -> Path:
    """A model directory in tmp_path: the stories tokenizer.json, optionally without its post-processor."""
    data = json.loads((STORIES_DIR / "tokenizer.json").read_text())
    if not post_processor:
        data["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    for name, content in (("tokenizer_config.json", tokenizer_config), ("config.json", config),
                          ("generation_config.json", generation_config)):
        if content is not None:
            (tmp_path / name).write_text(json.dumps(content))
    return tmp_path


def test_stories_settings(stories_tokenizer: Tokenizer) -> None:
    assert stories_tokenizer.bos_token_id == BOS
    assert stories_tokenizer.eos_token_ids == frozenset({EOS})
    assert stories_tokenizer.vocab_size == 512
    assert stories_tokenizer.add_bos_token is True
    assert stories_tokenizer.special_token_ids == frozenset({0, 1, 2})


@pytest.mark.parametrize("golden", load_goldens(), ids=lambda g: g["prompt"])
def test_encode_matches_golden_prompt_ids(stories_tokenizer: Tokenizer, golden: dict) -> None:
    assert stories_tokenizer.encode(golden["prompt"]) == golden["prompt_token_ids"]


@pytest.mark.parametrize("golden", load_goldens(), ids=lambda g: g["prompt"])
def test_decode_of_golden_is_prompt_then_text(stories_tokenizer: Tokenizer, golden: dict) -> None:
    prompt_ids, completion_ids = golden["prompt_token_ids"], golden["completion_token_ids"]
    assert stories_tokenizer.decode(prompt_ids) == golden["prompt"]
    assert stories_tokenizer.decode(prompt_ids + completion_ids) == golden["prompt"] + golden["text"]


def test_encode_and_decode_match_transformers(stories_tokenizer: Tokenizer, hf_tokenizer) -> None:
    texts = [g["prompt"] for g in load_goldens()] + UNICODE_TEXTS
    for text in texts:
        ids = stories_tokenizer.encode(text)
        assert ids == hf_tokenizer(text).input_ids
        assert stories_tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True) == text
        assert stories_tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
        assert stories_tokenizer.decode(ids, skip_special_tokens=False).startswith("<s>")


def test_unicode_round_trips_through_byte_fallback(stories_tokenizer: Tokenizer) -> None:
    ids = stories_tokenizer.encode("日本")
    # "▁" then the 6 UTF-8 bytes of 日本 as byte-fallback tokens (<0xE6> is id 3 + 0xE6).
    assert ids == [BOS, 410, 3 + 0xE6, 3 + 0x97, 3 + 0xA5, 3 + 0xE6, 3 + 0x9C, 3 + 0xAC]
    assert stories_tokenizer.decode(ids) == "日本"
    assert stories_tokenizer.decode(ids[:-1]) == "\ufffd" * 5  # an incomplete run of bytes: all U+FFFD


def test_bos_is_never_added_twice(stories_tokenizer: Tokenizer) -> None:
    # The post-processor adds <s>; a text that already starts with "<s>" keeps one.
    assert stories_tokenizer.encode("<s>Hi", parse_special_tokens=True) == [BOS, 320, 417]
    assert stories_tokenizer.encode("Hi") == [BOS, 320, 417]
    assert stories_tokenizer.encode("") == [BOS]


def test_add_bos_token_false_drops_post_processor_bos(tmp_path: Path) -> None:
    cfg = {"bos_token": "<s>", "add_bos_token": False}
    tok = Tokenizer.from_pretrained(make_model_dir(tmp_path, tokenizer_config=cfg))
    assert tok.add_bos_token is False
    assert tok.bos_token_id == BOS
    assert tok.encode("Once upon") == [403, 407]


@pytest.mark.parametrize(("add_bos", "expected"), [(True, [BOS, 403, 407]), (False, [403, 407])])
def test_add_bos_token_without_post_processor(tmp_path: Path, add_bos: bool, expected: list[int]) -> None:
    cfg = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", "add_bos_token": add_bos}
    tok = Tokenizer.from_pretrained(make_model_dir(tmp_path, tokenizer_config=cfg, post_processor=False))
    assert tok.encode("Once upon") == expected
    assert tok.encode("<s>Once upon", parse_special_tokens=True) == [BOS, 403, 407]  # the text's own <s>, once


def test_no_tokenizer_config_follows_post_processor_and_model_config(tmp_path: Path) -> None:
    model_dir = make_model_dir(tmp_path, tokenizer_config=None, config={"bos_token_id": 1, "eos_token_id": 2})
    tok = Tokenizer.from_pretrained(model_dir)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos_token) == (BOS, frozenset({EOS}), True)
    assert tok.encode("Once upon") == [BOS, 403, 407]


def test_no_configs_and_no_post_processor_adds_nothing(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(make_model_dir(tmp_path, tokenizer_config=None, post_processor=False))
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos_token) == (None, frozenset(), False)
    assert tok.encode("Once upon") == [403, 407]


def test_eos_ids_from_generation_config_list_and_tokenizer(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(make_model_dir(
        tmp_path, tokenizer_config={"bos_token": "<s>", "eos_token": "</s>"},
        config={"eos_token_id": 7}, generation_config={"eos_token_id": [13, 2]}))
    # generation_config overrides config.json; the tokenizer's eos (2) is always included.
    assert tok.eos_token_ids == frozenset({2, 13})


def test_eos_id_from_config_when_generation_config_is_silent(tmp_path: Path) -> None:
    model_dir = make_model_dir(tmp_path, tokenizer_config={"bos_token": "<s>"},
                               config={"eos_token_id": [2, 13]}, generation_config={"bos_token_id": 1})
    tok = Tokenizer.from_pretrained(model_dir)
    assert tok.eos_token_ids == frozenset({2, 13})


def test_missing_files_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
        Tokenizer.from_pretrained(tmp_path)


def test_bad_configs_raise_value_errors(tmp_path: Path) -> None:
    make_model_dir(tmp_path, tokenizer_config={"bos_token": "<bos>"})
    with pytest.raises(ValueError, match="bos_token '<bos>' is not in the vocabulary"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Tokenizer.from_pretrained(tmp_path)
    make_model_dir(tmp_path, tokenizer_config={"bos_token": None, "add_bos_token": True})
    with pytest.raises(ValueError, match="add_bos_token is true but the tokenizer has no bos_token"):
        Tokenizer.from_pretrained(tmp_path)
    make_model_dir(tmp_path, tokenizer_config={}, generation_config={"eos_token_id": 9999})
    with pytest.raises(ValueError, match=r"\[9999\] are outside the tokenizer's vocabulary \[0, 512\)"):
        Tokenizer.from_pretrained(tmp_path)


def test_coordinator_text_modules_import_no_torch() -> None:
    code = ("import sys, coordinator.tokenizer, coordinator.detokenizer, coordinator.stop_strings; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_special_token_spellings_are_literal_unless_parsing_is_asked_for(stories_tokenizer: Tokenizer) -> None:
    # Issue 11, fault 12: "</s>" in user text was the EOS id and "<unk>" id 0.
    literal = stories_tokenizer.encode("Hi</s><unk>")
    assert EOS not in literal[1:] and 0 not in literal and literal[0] == BOS
    assert stories_tokenizer.decode(literal) == "Hi</s><unk>"
    assert stories_tokenizer.encode("Hi</s><unk>", parse_special_tokens=True) == [BOS, 320, 417, EOS, 0]
    with_bos_text = stories_tokenizer.encode("<s>Hi")
    assert with_bos_text[0] == BOS and BOS not in with_bos_text[1:]  # the text's "<s>" is text


def _served_ids(model_dir: Path, text: str) -> list[int]:
    """Ids of ``text`` by the tokenizer.json that GetTokenizer serves for ``model_dir`` (with special tokens,
    as a client that loads the file alone encodes a prompt)."""
    import io
    import zipfile

    import tokenizers

    from coordinator.vllm_engine_service import tokenizer_archive

    data, _ = tokenizer_archive(model_dir, Tokenizer.from_pretrained(model_dir).served_json())
    served = zipfile.ZipFile(io.BytesIO(data)).read("tokenizer.json").decode()
    return tokenizers.Tokenizer.from_str(served).encode(text, add_special_tokens=True).ids


SERVED_PROMPTS = ["Once upon a time", "The little dog", "", " two  spaces", "日本"]


@pytest.mark.parametrize("model", ["stories260k", "default"])
def test_served_tokenizer_json_encodes_as_the_server(model: str) -> None:
    from tpserve.embedded_model import default_model_dir

    model_dir = STORIES_DIR if model == "stories260k" else default_model_dir()
    server = Tokenizer.from_pretrained(model_dir)
    assert server.served_json() is None  # their tokenizer.json already adds the bos: served as it is
    for text in SERVED_PROMPTS:
        assert _served_ids(model_dir, text) == server.encode(text)


@pytest.mark.parametrize(("add_bos", "post_processor", "expected"), [
    (True, False, [BOS, 403, 407]),  # converted SentencePiece models: the config says bos, the file has no processor
    (False, True, [403, 407]),  # the file adds a bos the config turns off
])
def test_served_tokenizer_json_follows_add_bos_token(tmp_path: Path, add_bos: bool, post_processor: bool,
                                                     expected: list[int]) -> None:
    """The served file used to be the directory's: the first case's client got [403, 407] where the
    server encodes [1, 403, 407], the second's [1, 403, 407] where the server encodes [403, 407]."""
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": add_bos}
    model_dir = make_model_dir(tmp_path, tokenizer_config=cfg, post_processor=post_processor)
    assert Tokenizer.from_pretrained(model_dir).encode("Once upon") == expected
    assert _served_ids(model_dir, "Once upon") == expected
    import tokenizers

    served = tokenizers.Tokenizer.from_str(Tokenizer.from_pretrained(model_dir).served_json())
    assert served.encode("Once", "upon").ids == ([BOS, 403, BOS, 407] if add_bos else [403, 407])  # pairs alike
    assert served.encode("Once upon", add_special_tokens=False).ids == [403, 407]


def test_served_tokenizer_json_keeps_an_eos_the_file_adds(tmp_path: Path) -> None:
    data = json.loads((STORIES_DIR / "tokenizer.json").read_text())
    data["post_processor"] = {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
        {"SpecialToken": {"id": "</s>", "type_id": 0}}], "pair": [
        {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}], "special_tokens": {
        "<s>": {"id": "<s>", "ids": [BOS], "tokens": ["<s>"]}, "</s>": {"id": "</s>", "ids": [EOS], "tokens": ["</s>"]}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "add_bos_token": False}))
    assert Tokenizer.from_pretrained(tmp_path).encode("Once upon") == [403, 407, EOS]
    assert _served_ids(tmp_path, "Once upon") == [403, 407, EOS]
