"""Every number a ``tpserve`` command takes, at its limits and one past them: a value in range is accepted
(or fails only for want of a server), one out of range is one line naming the flag and the range, exit 2,
before any call. Never a traceback: protobuf's ``Value out of range`` used to escape from the client.

``generate`` runs against a port nobody listens on (a value in range then ends as UNAVAILABLE, exit 1);
``serve``'s values are checked by its configuration, which is all ``serve`` reads before it starts
processes (tests/test_config.py covers the configuration's own rules).
"""

from __future__ import annotations


import pytest

from launch.cli import main
from tests.e2e.cluster import free_port
from tpserve.cli import build_parser, serve_config
from tpserve.client import build_request

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1


def _free_port() -> int:
    return free_port()  # outside the ephemeral range (tests/e2e/cluster.py)


def _one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


# flag -> (lowest valid, highest valid); one past either end is refused
GENERATE_LIMITS = {
    "--max-tokens": (1, INT32_MAX), "--top-k": (-1, INT32_MAX), "--seed": (0, UINT64_MAX),
    "--min-tokens": (0, INT32_MAX), "--top-logprobs": (0, 20), "--prompt-logprobs": (0, 20),
    "--stop-token-id": (-(2**31), INT32_MAX),
}
GENERATE_FLOAT_LIMITS = {  # flag -> (a value past the range, the range as the message says it)
    "--temperature": ("-1e-9", "a finite number >= 0"), "--top-p": ("0", "in (0, 1]"), "--min-p": ("1.5", "in [0, 1]"),
    "--typical-p": ("0", "in (0, 1]"), "--repetition-penalty": ("0", "a finite number > 0 (1 disables it)"),
    "--presence-penalty": ("2.01", "in [-2, 2]"), "--frequency-penalty": ("-2.01", "in [-2, 2]"),
}


def test_every_numeric_generate_flag_is_covered():
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]  # type: ignore[union-attr]
    numeric = {action.option_strings[0] for action in generate._actions
               if action.option_strings and action.type in (int, float)}
    assert numeric - {"--timeout"} == set(GENERATE_LIMITS) | set(GENERATE_FLOAT_LIMITS)


def _generate(capsys, *argv: str) -> tuple[int, str]:
    code = main(["generate", "--target", f"127.0.0.1:{_free_port()}", *argv, "Hi"])
    return code, _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("flag", sorted(GENERATE_LIMITS))
def test_generate_integer_flags_at_their_limits(flag, capsys):
    extra = ["--json", "--logprobs"] if flag == "--top-logprobs" else ["--json"] if flag == "--prompt-logprobs" else []
    low, high = GENERATE_LIMITS[flag]
    for value in (low, high):
        code, line = _generate(capsys, *extra, flag, str(value))
        assert code == 1 and line.startswith("UNAVAILABLE: "), line  # sent: only the server is missing
    for value in (low - 1, high + 1):
        code, line = _generate(capsys, *extra, f"{flag}={value}")
        assert code == 2
        assert line == f"tpserve generate: {flag} must be in [{low}, {high}], got {value}"


@pytest.mark.parametrize("flag", sorted(GENERATE_FLOAT_LIMITS))
def test_generate_float_flags_past_their_range(flag, capsys):
    value, range_text = GENERATE_FLOAT_LIMITS[flag]
    for bad in (value, "nan", "inf"):
        code, line = _generate(capsys, f"{flag}={bad}")  # "=": argparse would read "-1e-9" as a flag
        assert code == 2 and line.startswith(f"tpserve generate: {flag} must be {range_text}, got "), line


@pytest.mark.parametrize("argv, expected", [
    (["--timeout", "0"], "tpserve generate: --timeout must be a number of seconds in (0, 1e9), got 0"),
    (["--timeout", "nan"], "tpserve generate: --timeout must be a number of seconds in (0, 1e9), got nan"),
    (["--logit-bias", "5=100.5"], "tpserve generate: --logit-bias takes TOKEN_ID in [0, 2147483647] and BIAS in "
                                  "[-100, 100], got '5=100.5'"),
    (["--logit-bias", f"{INT32_MAX + 1}=1"], "tpserve generate: --logit-bias takes TOKEN_ID in [0, 2147483647] and "
                                             f"BIAS in [-100, 100], got '{INT32_MAX + 1}=1'"),
])
def test_generate_other_numbers(argv, expected, capsys):
    assert _generate(capsys, *argv) == (2, expected)


def test_an_empty_chat_message_is_refused(capsys):
    assert main(["generate", "--target", f"127.0.0.1:{_free_port()}", "--chat", " "]) == 2
    assert _one_line(capsys.readouterr().err) == "tpserve generate: --chat needs a message: the prompt is empty"


def test_the_client_names_the_field_out_of_its_wire_range():
    with pytest.raises(ValueError, match=r"^max_tokens: Value out of range: 2147483648"):
        build_request("Hi", max_tokens=INT32_MAX + 1)


# serve flag -> (lowest valid, highest valid) for integers the configuration bounds both ways
SERVE_LIMITS = {
    "--max-num-seqs": (1, INT32_MAX), "--max-num-batched-tokens": (1, INT32_MAX), "--max-model-len": (2, INT32_MAX),
    "--max-queue-len": (1, INT32_MAX), "--num-gpu-blocks-override": (1, INT32_MAX), "--block-size": (1, 1024),
    "--stream-interval": (1, INT32_MAX), "--port": (0, 65535), "--metrics-port": (0, 65535),
    "--kv-cache-memory-bytes": (1, 2**63 - 1), "--tensor-parallel-size": (1, 64),
}


def _serve(*argv: str):
    return serve_config(build_parser().parse_args(["serve", *argv]))


@pytest.mark.parametrize("flag", sorted(SERVE_LIMITS))
def test_serve_integer_flags_at_their_limits(flag):
    low, high = SERVE_LIMITS[flag]
    for value in (low, high):
        _serve(flag, str(value))
    for value in (low - 1, high + 1):
        with pytest.raises(ValueError):
            _serve(flag, str(value))


@pytest.mark.parametrize("flag", ["--step-timeout-seconds", "--distributed-timeout-seconds",
                                  "--worker-start-timeout-seconds", "--shutdown-grace-seconds",
                                  "--worker-recovery-timeout-seconds", "--gpu-memory-utilization"])
@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_serve_seconds_are_finite(flag, value, capsys, monkeypatch):
    monkeypatch.setattr("tpserve.log.configure_logging", lambda *args, **kwargs: None)
    assert main(["serve", flag, value]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"tpserve serve: {flag}: "), line
