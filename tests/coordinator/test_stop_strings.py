"""StopStringMatcher: hand-picked streams, then random texts split at random against a plain oracle."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from coordinator.stop_strings import StopStringMatcher


def run(stop: Sequence[str], deltas: Sequence[str]) -> tuple[list[str], bool, str]:
    """Pushes deltas until a match; returns each push's text, whether it matched, and the flush."""
    matcher = StopStringMatcher(stop)
    emitted = []
    for delta in deltas:
        text, matched = matcher.push(delta)
        emitted.append(text)
        if matched:
            return emitted, True, matcher.flush()
    return emitted, False, matcher.flush()


def oracle(text: str, stop: Sequence[str]) -> str:
    """Text before the first stop string to be complete, reading left to right (longest on a tie)."""
    for end in range(1, len(text) + 1):
        for s in sorted(stop, key=len, reverse=True):
            if text[:end].endswith(s):
                return text[: end - len(s)]
    return text


def test_no_stop_strings_pass_text_through() -> None:
    assert run([], ["a", "b"]) == (["a", "b"], False, "")


def test_held_prefix_is_released_once_it_cannot_match() -> None:
    matcher = StopStringMatcher(["ab"])
    assert matcher.push("xa") == ("x", False)
    assert matcher.held_text == "a"
    assert matcher.push("c") == ("ac", False)
    assert matcher.held_text == ""


def test_stop_inside_one_delta_drops_it_and_what_follows() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("hello STOP world") == ("hello ", True)
    assert matcher.stopped
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""


def test_stop_spanning_three_deltas() -> None:
    assert run(["abcd"], ["xa", "bc", "dy"]) == (["x", "", ""], True, "")
    assert run(["\n\nUser:"], ["Hi.\n", "\nUs", "er:", " ignored"]) == (["Hi.", "", ""], True, "")


def test_partial_prefix_then_mismatch_releases_text() -> None:
    assert run(["abc"], ["xab", "d", "e"]) == (["x", "abd", "e"], False, "")


def test_flush_releases_held_text_at_the_end() -> None:
    assert run(["abc"], ["xab"]) == (["x"], False, "ab")


def test_self_overlapping_stop() -> None:
    # After "aaa" only "aa" can still begin "aab": the first "a" is released.
    assert run(["aab"], ["a", "a", "a", "b", "z"]) == (["", "", "a", ""], True, "")


def test_earliest_match_wins_among_several_stops() -> None:
    assert run(["world", "lo"], ["hello world"]) == (["hel"], True, "")
    assert run(["world", "lo"], ["hel", "l", "o world"]) == (["he", "l", ""], True, "")
    assert run(["x", "y"], ["aya", "x"]) == (["a"], True, "")


def test_stop_that_is_a_prefix_of_another() -> None:
    # "ab" is complete before "abc" can be: it wins, however the text is split.
    assert run(["abc", "ab"], ["xabc"]) == (["x"], True, "")
    assert run(["abc", "ab"], ["xa", "b", "c"]) == (["x", ""], True, "")
    assert run(["abc", "ab"], ["xa", "d"]) == (["x", "ad"], False, "")
    # "bc" ends before "abcd" does, so it wins even though "abcd" starts first.
    assert run(["bc", "abcd"], ["abcd"]) == (["a"], True, "")
    assert run(["bc", "abcd"], ["a", "b", "c", "d"]) == (["", "", "a"], True, "")


def test_unicode_stops() -> None:
    assert run(["日本"], ["今日", "本は"]) == (["今", ""], True, "")
    assert run(["🙂"], ["ok 🙂 no"]) == (["ok "], True, "")
    assert run(["é!"], ["caf", "é", "?"]) == (["caf", "", "é?"], False, "")
    family = "👨\u200d👩\u200d👧"
    assert run([family], ["a👨\u200d", "👩\u200d", "👧 b"]) == (["a", "", ""], True, "")


def test_invalid_stops_are_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])
    with pytest.raises(TypeError, match="must be str"):
        StopStringMatcher([b"bytes"])  # type: ignore[list-item]


def random_stop(rng: random.Random, text: str, alphabet: str) -> str:
    """Half the time a piece of the text (so stops overlap and nest), else random characters."""
    size = rng.randint(1, 4)
    if text and rng.random() < 0.5:
        start = rng.randrange(len(text))
        return text[start:start + size]
    return "".join(rng.choice(alphabet) for _ in range(size))


def test_random_splits_match_the_oracle() -> None:
    rng = random.Random(1234)
    alphabet = "abé日🙂 "
    num_matched = 0
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stop = [random_stop(rng, text, alphabet) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        matcher = StopStringMatcher(stop)
        emitted, matched = [], False
        for delta in deltas:
            out, matched = matcher.push(delta)
            emitted.append(out)
            assert len(matcher.held_text) <= max(map(len, stop)) - 1
            if matched:
                break
        if not matched:
            emitted.append(matcher.flush())
        expected = oracle(text, stop)
        assert "".join(emitted) == expected, (text, stop, deltas)
        assert matched == any(s in text for s in stop)
        num_matched += matched
    assert 300 < num_matched < 2700  # both outcomes are well exercised


# -- min_tokens: vLLM's rule (v1's detokenizer checks stop strings only once len(output_token_ids) > min_tokens) --


def test_no_stop_string_ends_in_the_first_min_tokens_tokens() -> None:
    """The probe's case: min_tokens 20 and stop "." gave 11 tokens; vLLM gives at least 20, then the next "."."""
    tokens = ["Lily", ".", " She", " was", " happy", ".", " The"]
    matcher = StopStringMatcher(["."], min_tokens=3)
    emitted = []
    for num_tokens, delta in enumerate(tokens, 1):
        text, matched = matcher.push(delta, num_tokens)
        emitted.append(text)
        if matched:
            break
    assert "".join(emitted) == "Lily. She was happy" and matched and num_tokens == 6


def test_a_stop_string_that_starts_before_the_boundary_and_ends_after_it_matches() -> None:
    for min_tokens, expected in [(2, ("xa", True)), (3, ("xabcd", False))]:
        matcher = StopStringMatcher(["bcd"], min_tokens=min_tokens)
        pushed = [matcher.push(delta, n) for n, delta in enumerate(["xab", "c", "d"], 1)]
        text, matched = "".join(t for t, _ in pushed), pushed[-1][1]
        assert (text + ("" if matched else matcher.flush()), matched) == expected, min_tokens


def test_random_token_streams_with_min_tokens_match_the_oracle() -> None:
    """A match must end in the text of a token after the first ``min_tokens`` (earliest end first, longest on a tie)."""
    rng = random.Random(99)
    alphabet = "ab.é "
    num_matched = num_skipped = 0
    for _ in range(3000):
        tokens = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 10))]
        text = "".join(tokens)
        stop = [random_stop(rng, text, alphabet) for _ in range(rng.randint(1, 3))]
        min_tokens = rng.randint(0, len(tokens))
        boundary = len("".join(tokens[:min_tokens]))
        expected, found = text, False
        for end in range(boundary + 1, len(text) + 1):
            ending = [s for s in stop if text[:end].endswith(s)]
            if ending:
                expected, found = text[:end - max(map(len, ending))], True
                break
        matcher = StopStringMatcher(stop, min_tokens=min_tokens)
        emitted, matched = [], False
        for num_tokens, delta in enumerate(tokens, 1):
            out, matched = matcher.push(delta, num_tokens)
            emitted.append(out)
            if matched:
                break
        if not matched:
            emitted.append(matcher.flush())
        assert ("".join(emitted), matched) == (expected, found), (tokens, stop, min_tokens)
        num_matched += matched
        num_skipped += not found and any(s in text for s in stop)
    assert num_matched > 300 and num_skipped > 300  # both the rule and plain matching are exercised
