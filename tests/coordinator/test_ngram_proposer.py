"""The n-gram (prompt lookup) proposer and the per-sequence switch-off: pure Python."""

from __future__ import annotations

import pytest

from coordinator.ngram_proposer import DraftModelProposer, NgramProposer, make_proposer
from coordinator.spec_decode import AdaptiveSpeculation
from tpserve.config import ClusterConfig, RankConfig, SpeculativeConfig


def test_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    proposer = NgramProposer(3, 1, 3)
    assert proposer.propose([1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2]) == (3, 5, 1)  # the later "1 2" wins
    assert proposer.propose([1, 2, 3, 4, 5]) == ()  # no n-gram repeats
    assert proposer.propose([7]) == () and proposer.propose([]) == ()


def test_the_longest_matching_ngram_wins() -> None:
    # "8 1 2" occurs once (followed by 6); "1 2" alone occurs later (followed by 4).
    tokens = [8, 1, 2, 6, 6, 1, 2, 4, 4, 8, 1, 2]
    assert NgramProposer(2, 1, 3).propose(tokens) == (6, 6)
    assert NgramProposer(2, 1, 2).propose(tokens) == (4, 4)
    assert NgramProposer(2, 4, 4).propose(tokens) == ()  # "2 8 1 2" never occurred before


def test_a_loop_is_read_on_as_a_copy() -> None:
    # "5 6" two tokens back: the continuation repeats with period 2 for the k tokens.
    assert NgramProposer(5, 2, 2).propose([1, 5, 6, 5, 6]) == (5, 6, 5, 6, 5)
    assert NgramProposer(4, 3, 3).propose([7, 7, 7, 7]) == (7, 7, 7, 7)


def test_the_limit_caps_the_proposal() -> None:
    proposer = NgramProposer(4, 1, 2)
    tokens = [3, 4, 5, 6, 7, 3, 4]
    assert proposer.propose(tokens) == (5, 6, 7, 3)
    assert proposer.propose(tokens, max_tokens=2) == (5, 6) and proposer.propose(tokens, max_tokens=0) == ()


def test_matches_are_whole_tokens_not_bytes() -> None:
    # 256 is bytes 00 01 00 00 and 1 is 01 00 00 00: "1" appears inside "256 0" at a byte offset.
    assert NgramProposer(2, 1, 1).propose([256, 0, 9, 1]) == ()
    assert NgramProposer(2, 1, 1).propose([256, 1, 0, 0, 1]) == (0, 0)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0, 1, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, 3, 2)


def test_config_follows_vllm_defaults_and_names_the_field() -> None:
    assert make_proposer(SpeculativeConfig()) is None
    proposer = make_proposer(SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=3))
    assert (proposer.num_speculative_tokens, proposer.prompt_lookup_min, proposer.prompt_lookup_max) == (3, 5, 5)
    config = SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=2, prompt_lookup_max=4)
    assert config.lookup_range == (4, 4)
    config = SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=2, prompt_lookup_min=2)
    assert config.lookup_range == (2, 2)
    with pytest.raises(ValueError, match="needs num_speculative_tokens"):
        ClusterConfig.load_from(None, {"speculative": {"speculative_method": "ngram"}})
    with pytest.raises(ValueError, match="prompt_lookup_min=4 must be <= prompt_lookup_max=2"):
        SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=2, prompt_lookup_min=4,
                          prompt_lookup_max=2)
    with pytest.raises(ValueError, match="speculative_method"):
        SpeculativeConfig(speculative_method="eagle", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="need speculative_method"):
        SpeculativeConfig(num_speculative_tokens=2)
    with pytest.raises(ValueError, match=r"speculative_method=draft needs speculative_model \(the draft model's "):
        SpeculativeConfig(speculative_method="draft", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative_model .* is used only with speculative_method=draft, got "
                                         "speculative_method=ngram"):
        SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=2, speculative_model="/m")
    draft = make_proposer(SpeculativeConfig(speculative_method="draft", num_speculative_tokens=3, speculative_model="/m"))
    assert isinstance(draft, DraftModelProposer) and draft.on_workers and draft.num_to_propose(2) == 2
    config = ClusterConfig.load_from(None, {"speculative": {"speculative_method": "draft", "speculative_model": "/m",
                                                            "num_speculative_tokens": 3}})
    sent = RankConfig.from_json(RankConfig(cluster=config, model_dir="/t", rank=0, world_size=1, local_rank=0,
                                           local_world_size=1, address="unix:///x", init_method="file:///y").to_json())
    assert sent.cluster.speculative == config.speculative  # what the ranks size the draft's cache from


def test_adaptive_speculation_pauses_longer_each_time() -> None:
    state = AdaptiveSpeculation()
    num_output = 0
    pauses = []
    while len(pauses) < 3:
        assert state.allowed(num_output)
        state.record(4, 0, num_output)
        if not state.allowed(num_output):
            pauses.append(state.resume_at - num_output)
            num_output = state.resume_at
        num_output += 1
    assert pauses == [16, 32, 64]
    good = AdaptiveSpeculation()
    for num_output in range(100):
        good.record(4, 2, num_output)  # half accepted: never paused
    assert good.allowed(100) and good.resume_at == 0
