"""The CLI as a person reads it: every flag has a help line that shows its default, the README's flag
tables match the parser (every flag documented, none that does not exist), and the Python client's
methods show their keyword arguments to ``help()``."""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

import pytest

from tpserve.cli import build_parser
from tpserve.client import AsyncClient, Client, build_request

README = Path(__file__).resolve().parent.parent / "README.md"


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"}


@pytest.mark.parametrize("command", ["serve", "generate", "info", "bench"])
def test_every_flag_has_a_help_line(command):
    parser = _commands()[command]
    missing = [action.option_strings or action.dest for action in parser._actions if not (action.help or "").strip()]
    assert not missing, f"tpserve {command}: flags without help: {missing}"


def test_help_shows_defaults():
    commands = _commands()
    serve = " ".join(commands["serve"].format_help().split())
    for shown in ("number of worker ranks the model is split over (default: 1)", "gRPC port (default: 50051)",
                  "tokens per KV cache block (default: 16)", "address to bind (default: 0.0.0.0)", "(default: console)",
                  "reuse the KV blocks of shared prompt prefixes (default: on)",
                  "0 runs the coordinator (default: 0)", "(default: none, or the checkpoint's quantization_config)",
                  "use exactly this many KV blocks (default: as many as the memory budget holds)"):
        assert shown in serve, shown
    assert "(default: None)" not in serve and "(default: False)" not in serve
    generate = " ".join(commands["generate"].format_help().split())
    assert "(port 50051 if none) (default: 127.0.0.1:50051)" in generate
    assert "0 or -1 (vLLM's) keeps all (default: 0)" in generate
    bench = " ".join(commands["bench"].format_help().split())
    assert "requests per load (default: 200)" in bench and "(default: None)" not in bench


@pytest.mark.parametrize("command", ["serve", "generate", "info", "bench"])
def test_every_default_is_spelled_one_way(command):
    """"(default: X)" or "; default: X", never "(default X)", "default X" or "X (default)"."""
    text = " ".join(_commands()[command].format_help().split())
    assert not re.findall(r"\(default [^:]|; default [^:]|\(default\)", text)


def test_api_key_from_the_environment_is_not_shown(monkeypatch):
    monkeypatch.setenv("TPSERVE_API_KEY", "sk-secret-123")
    assert "sk-secret-123" not in _commands()["generate"].format_help()


def _readme_table_flags(heading: str) -> set[str]:
    """The flags in the first column of the README table that follows ``heading``."""
    text = README.read_text()
    start = text.index(heading)
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return {flag for row in rows[1:] for flag in re.findall(r"--[a-z][a-z0-9-]*", row.split("|")[1])}


@pytest.mark.parametrize("command, heading", [
    ("serve", "| flag (vLLM's names) | default | meaning |"),
    ("generate", "| `tpserve generate` flag | default | meaning |"),
])
def test_readme_flag_table_matches_the_parser(command, heading):
    documented = _readme_table_flags(heading)
    parser_flags = _flags(_commands()[command])
    assert not parser_flags - documented, f"tpserve {command} flags missing from the README: " \
                                          f"{sorted(parser_flags - documented)}"
    assert not documented - parser_flags, f"README flags tpserve {command} does not have: " \
                                          f"{sorted(documented - parser_flags)}"


def test_readme_documents_tpserve_info():
    assert "tpserve info" in README.read_text()


@pytest.mark.parametrize("method", [Client.generate, Client.generate_stream, AsyncClient.generate,
                                    AsyncClient.generate_stream])
def test_client_methods_take_explicit_keyword_arguments(method):
    parameters = inspect.signature(method).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    fields = set(inspect.signature(build_request).parameters)
    assert set(parameters) - {"self", "timeout_s"} == fields
    assert all(p.annotation is not inspect.Parameter.empty for name, p in parameters.items() if name != "self")


@pytest.mark.parametrize("given", [dict(json_schema={"type": "string"}, regex="[a-z]+"),
                                   dict(regex="[a-z]+", choices=["yes", "no"]),
                                   dict(json_schema="{}", choices=["yes"])])
def test_two_output_constraints_are_refused(given):
    with pytest.raises(ValueError, match="give one of json_schema, regex and choices"):
        build_request("Hi", **given)
