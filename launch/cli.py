"""The ``tpserve`` console script: every command of :func:`tpserve.cli.build_parser`, with ``serve`` run here.

``serve`` builds the configuration from ``--config`` and the flags (:func:`tpserve.cli.serve_config`)
and runs a :class:`launch.leader.Leader`, or with ``--headless`` a :class:`launch.headless.HeadlessNode`.
Each is imported only when it runs: ``generate`` does not pay for the server's imports, and a
headless node imports no coordinator module (tests/test_import_rules.py). ``python -m launch.cli``
is the same command.
"""

from __future__ import annotations

import argparse
import sys

from tpserve import event_loop
from tpserve.cli import as_flags, build_parser, config_error, run_client_command, serve_config


def main(argv: list[str] | None = None) -> int:
    """Runs one ``tpserve`` command; returns the process exit code."""
    args = build_parser().parse_args(argv)
    if args.command != "serve":
        return run_client_command(args)
    try:
        return serve(args)
    except KeyboardInterrupt:  # Ctrl-C before the server's own signal handlers are installed
        return 130


def serve(args: argparse.Namespace) -> int:
    """``tpserve serve``: 2 for a bad configuration or model, 1 for a failed start or a failed group, else 0."""
    from launch.startup import StartupError
    from tpserve.log import configure_logging

    configure_logging(args.log_format)
    try:
        config = serve_config(args)
    except OSError as exc:
        print(f"tpserve serve: --config {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"tpserve serve: {config_error(exc)}", file=sys.stderr)
        return 2
    try:
        if config.parallel.headless:
            from launch.headless import HeadlessNode

            node = HeadlessNode(config, log_format=args.log_format)
        else:
            from launch.leader import Leader

            node = Leader(config, log_format=args.log_format)
    except (StartupError, ValueError, OSError) as exc:
        print(f"tpserve serve: {config_error(exc)}", file=sys.stderr)
        return 2
    try:
        return event_loop.run(node.serve())  # uvloop where installed: less CPU per streamed token
    except StartupError as exc:  # a port in use, a peer that never came, or refused this node
        print(f"tpserve serve: {as_flags(str(exc))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
