"""``tpserve generate``: its checks before any call, the call, what it prints, and its lines about a moving
stream. The flags are declared in :mod:`tpserve.cli` (from the sampling table, tpserve/sampling_fields.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc
from google.protobuf.descriptor import FieldDescriptor

from tpserve.sampling_fields import FIELDS, SamplingField, check_value
from tpserve.v1 import generate_pb2 as pb


def credentials(args: argparse.Namespace):
    """The TLS and API-key credentials the flags give (``tpserve.client.Credentials``)."""
    from tpserve.client import Credentials

    try:
        return Credentials.from_flags(args)
    except ValueError as exc:  # a certificate without its key
        raise UsageError(str(exc)) from None


class UsageError(Exception):
    """A flag combination or a flag's file that ``tpserve generate`` / ``info`` cannot use; the message says
    which flags and what to do."""


_WIRE_TYPES = {FieldDescriptor.TYPE_INT32: "int32", FieldDescriptor.TYPE_UINT32: "uint32", FieldDescriptor.TYPE_INT64: "int64",
               FieldDescriptor.TYPE_UINT64: "uint64", FieldDescriptor.TYPE_FLOAT: "float", FieldDescriptor.TYPE_DOUBLE: "double"}


def sampling_wire_type(name: str) -> str:
    """The proto scalar type of ``SamplingParams.<name>`` (``"int32"``, ``"uint64"``, ``"float"``, ...; a
    map's key type); "" for others. The range a client can send is that type's (:func:`check_sampling_value`)."""
    field = pb.SamplingParams.DESCRIPTOR.fields_by_name[name]
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        field = field.message_type.fields_by_name["key"]
    return _WIRE_TYPES.get(field.type, "")


def check_sampling_value(spec: SamplingField, value: float) -> str | None:
    """:func:`tpserve.sampling_fields.check_value` within ``spec``'s wire type: what is wrong with
    ``value``, or None."""
    return check_value(spec, value, sampling_wire_type(spec.name))



def check_generate_flags(args: argparse.Namespace) -> None:
    """Refuses the combinations argparse cannot see.

    Raises:
        UsageError: naming the flags.
    """
    if not args.json:
        for flag, given in (("--logprobs", args.logprobs), ("--top-logprobs", args.top_logprobs is not None),
                            ("--prompt-logprobs", args.prompt_logprobs is not None)):
            if given:
                raise UsageError(f"{flag} is printed only in the JSON object: add --json")
    if args.top_logprobs is not None and not args.logprobs:
        raise UsageError("--top-logprobs goes with --logprobs: add --logprobs")
    if args.system is not None and not args.chat:
        raise UsageError("--system goes with --chat (a system message before the prompt): add --chat")
    if args.prompt_logprobs is not None and args.stream:
        raise UsageError("--prompt-logprobs comes with the unary call: drop --stream")
    if args.chat and not args.prompt.strip():
        raise UsageError("--chat needs a message: the prompt is empty")
    _check_numbers(args)


def _check_numbers(args: argparse.Namespace) -> None:
    """Every number against its field's range and the protocol's (an int32 holds at most 2147483647), before
    any call: protobuf would raise a bare ``Value out of range`` from deep in the client.

    Raises:
        UsageError: naming the flag, the range and the value.
    """
    for spec in FIELDS:
        if not spec.cli or spec.type in (bool, dict):
            continue
        values = getattr(args, spec.name)
        for value in (values if spec.type is list else [values]):
            if value is None or isinstance(value, str):
                continue
            problem = check_sampling_value(spec, value)
            if problem:
                raise UsageError(f"{spec.flag} {problem}")
    if args.timeout is not None and not 0 < args.timeout < 1e9:  # NaN too; grpc takes no deadline of 30 years
        raise UsageError(f"--timeout must be a number of seconds in (0, 1e9), got {args.timeout:g}")


def _json_schema(value: str | None) -> str | None:
    """``--json-schema``'s text, read from the file after ``@``.

    Raises:
        UsageError: the file cannot be read.
    """
    if value is None or not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as exc:
        raise UsageError(f"--json-schema {value}: cannot read {value[1:]} ({exc.strerror}); give a JSON schema file "
                         "after @, or the schema itself") from None
    except UnicodeDecodeError:
        raise UsageError(f"--json-schema {value}: {value[1:]} is not UTF-8 text") from None


def checked_target(target: str) -> str:
    """``--target`` with tpserve's port where it names a host alone, checked before any call
    (``tpserve.client.check_target``).

    Raises:
        UsageError: a target gRPC cannot dial (a port that is not a number in 1-65535, ...), naming the flag.
    """
    from tpserve.client import check_target, with_default_port

    target = with_default_port(target)
    try:
        check_target(target)
    except ValueError as exc:
        raise UsageError(f"--target {exc}") from None
    return target


class MoveReporter:
    """Says each move of a request on stderr, on a line of its own (tpserve/stream_move.py): a stream's,
    which continues after the tokens it delivered, or a unary call's, which is sent again whole.

    A streamed completion is printed without a newline; where stdout and stderr share a terminal, a move's
    line would be glued to the text, so it starts with a newline there. A target of one address is retried
    ("retrying on HOST:PORT"), one of several continues on another of them.
    """

    def __init__(self, target: str, stream: bool) -> None:
        from tpserve.client import with_default_port

        self.target = with_default_port(target)
        self.stream = stream
        self.single = num_addresses(self.target) <= 1
        self.open_line = False  # the streamed text printed so far does not end with a newline
        self.moves = 0

    def printed(self, text: str) -> None:
        """Records text printed to stdout."""
        if text:
            self.open_line = not text.endswith("\n")

    def __call__(self, move) -> None:
        self.moves = move.attempt
        glued = self.open_line and sys.stdout.isatty() and sys.stderr.isatty()
        if self.stream:
            where = f"retrying on {self.target}" if self.single else "continuing on another replica"
            what = f"{where} after {move.num_delivered_tokens} tokens"
        else:  # nothing was delivered: the whole request goes again
            what = f"retrying on {self.target}" if self.single else "retrying on another replica"
        print(f"{chr(10) if glued else ''}tpserve generate: {move.code.name} ({move.details}); {what} "
              f"(attempt {move.attempt}, in {move.backoff_s:.1f} s)", file=sys.stderr, flush=True)
        self.open_line = False

    def gave_up(self) -> str:
        """What the last line adds after the error: how many moves were tried."""
        if self.stream:
            return f"(gave up after {self.moves} tries to continue the stream)"
        return f"(gave up after {self.moves} {'retry' if self.moves == 1 else 'retries'})"


def num_addresses(target: str) -> int:
    """How many addresses ``target`` names: an ``ipv4:``/``ipv6:`` list's length, a host's DNS answers
    (0 when it does not resolve), 1 for a unix socket."""
    import socket

    scheme, _, rest = target.partition(":")
    if scheme in ("ipv4", "ipv6"):
        return len(rest.split(","))
    if scheme in ("unix", "unix-abstract"):
        return 1
    host, _, port = target.removeprefix("dns:///").rpartition(":")
    try:
        return len({info[4][0] for info in socket.getaddrinfo(host.strip("[]"), port or None, type=socket.SOCK_STREAM)})
    except (OSError, UnicodeError):
        return 0


def generate(args: argparse.Namespace) -> int:
    """Runs ``tpserve generate``; returns the exit code (1 for a failed call after a stream moved; other
    failures raise: :class:`UsageError`, ``grpc.RpcError``, ``OSError``, which ``tpserve.cli`` reports)."""
    check_generate_flags(args)
    sampling = {spec.name: getattr(args, spec.name) for spec in FIELDS if spec.cli}
    sampling.update(logit_bias=_logit_bias(args.logit_bias), regex=args.regex, choices=args.choices,
                    cache_salt=args.cache_salt, json_schema=_json_schema(args.json_schema), lora_name=args.lora,
                    parse_special_tokens=args.parse_special_tokens)
    reporter = MoveReporter(args.target, args.stream)
    try:
        result = run_generate(args, sampling, reporter)
    except grpc.RpcError as exc:
        if reporter.open_line and sys.stdout.isatty() and sys.stderr.isatty():
            print(file=sys.stderr)  # the streamed text's line is open: the error goes on a line of its own
        if not reporter.moves:
            raise  # tpserve.cli reports it
        from tpserve.client import describe_rpc_error

        print(f"{describe_rpc_error(exc, reporter.target, tls=credentials(args).tls)} {reporter.gave_up()}",
              file=sys.stderr)
        return 1
    print_result(args, result)
    return 0


def run_generate(args: argparse.Namespace, sampling: dict, reporter: MoveReporter):
    """The completion (a ``GenerateResult``), printed as it arrives with ``--stream``."""
    from tpserve.client import Client, GenerateResult
    from tpserve.stream_move import MovePolicy

    with Client(args.target, credentials=credentials(args), move_policy=MovePolicy(on_move=reporter)) as client:
        if not args.stream:
            result = client.generate(_prompt(args), timeout_s=args.timeout, **sampling)
        else:
            text, token_ids, logprobs, last = [], [], [], None
            for chunk in client.generate_stream(_prompt(args), timeout_s=args.timeout, **sampling):
                if not args.json:
                    print(chunk.text, end="", flush=True)
                    reporter.printed(chunk.text)
                text.append(chunk.text)
                token_ids.extend(chunk.token_ids)
                logprobs.extend(chunk.logprobs)
                last = chunk
            assert last is not None, "a stream ends with a message carrying its finish_reason"
            result = GenerateResult(last.request_id, "".join(text), token_ids, last.finish_reason, last.usage,
                                    tuple(logprobs), timings=last.timings)
    return result


def print_result(args: argparse.Namespace, result) -> None:
    """``--json``'s object, or the text (after a stream: its final newline)."""
    if args.json:
        obj = result.to_json_dict()
        if args.logprobs:
            from google.protobuf.json_format import MessageToDict

            obj["logprobs"] = [MessageToDict(lp, preserving_proto_field_name=True) for lp in result.logprobs]
        if args.prompt_logprobs is not None and not args.stream:
            from google.protobuf.json_format import MessageToDict

            obj["prompt_logprobs"] = [MessageToDict(lp, preserving_proto_field_name=True)
                                      for lp in result.prompt_logprobs]
        print(json.dumps(obj, ensure_ascii=False))
    elif args.stream:
        print()
    else:
        print(result.text)


def _prompt(args: argparse.Namespace) -> str | list[dict[str, str]]:
    """The prompt text, or with ``--chat`` the messages (an optional system one, then the user's)."""
    if not args.chat:
        return args.prompt
    system = [{"role": "system", "content": args.system}] if args.system else []
    return [*system, {"role": "user", "content": args.prompt}]


def _logit_bias(pairs: list[str]) -> dict[int, float]:
    """``["TOKEN_ID=BIAS", ...]`` as a dict (argparse exits with the message on a malformed pair)."""
    bias = {}
    for pair in pairs:
        token, sep, value = pair.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise UsageError(f"--logit-bias expects TOKEN_ID=BIAS, got {pair!r}") from None
        if not sep:
            raise UsageError(f"--logit-bias expects TOKEN_ID=BIAS, got {pair!r}")
        if not 0 <= int(token) < 2**31 or not -100 <= float(value) <= 100:  # the server's range; int32 ids
            raise UsageError(f"--logit-bias takes TOKEN_ID in [0, 2147483647] and BIAS in "
                             f"[-100, 100], got {pair!r}")
    return bias
