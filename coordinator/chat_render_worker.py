"""A chat-template renderer process (``python -m coordinator.chat_render_worker``).

Started and killed by :class:`coordinator.chat_renderer.ChatRenderPool`. It reads
requests from stdin and writes one reply per request to stdout; every frame is a 4-byte
big-endian length and that many bytes of JSON:

- request: ``{"template", "messages", "special_tokens", "timeout_s"}``;
- reply: ``{"text": ...}``, or ``{"error": ...}`` when the template refuses the
  messages, runs out of its address space or renders too much.

Its address space is limited (``RLIMIT_AS``, so a template that builds a huge string
gets a ``MemoryError`` here instead of swapping the host), and each render arms an
alarm whose default action ends the process even inside one long C-level operation
(``10 ** 10 ** 9``), in case its parent is gone and cannot kill it. It exits at end of
input (the parent closed the pipe or died). No torch.
"""

from __future__ import annotations

import json
import math
import resource
import signal
import struct
import sys

#: Address space of a renderer: the interpreter and jinja2 take about 50 MiB.
ADDRESS_SPACE_BYTES = 1024**3
#: Longest rendered prompt, in characters: four times the contents' limit (1 MiB).
MAX_RENDERED_CHARS = 4 * 1024**2


def read_frame(stream) -> dict | None:
    """One length-prefixed JSON object from ``stream``, or None at end of input."""
    header = stream.read(4)
    if len(header) < 4:
        return None
    (size,) = struct.unpack(">I", header)
    body = stream.read(size)
    if len(body) < size:
        return None
    return json.loads(body)


def frame(obj: dict) -> bytes:
    """``obj`` as a length-prefixed JSON frame."""
    body = json.dumps(obj).encode()  # ASCII: any str survives, lone surrogates included
    return struct.pack(">I", len(body)) + body


def render(request: dict) -> dict:
    """The reply to one request."""
    from coordinator.chat import render_chat
    from coordinator.errors import InvalidArgumentError

    try:
        text = render_chat(request["template"], request["messages"], request["special_tokens"])
    except InvalidArgumentError as exc:
        return {"error": str(exc)}
    except MemoryError:
        return {"error": f"messages: the model's chat template needs more than {ADDRESS_SPACE_BYTES >> 20} MiB "
                         "to render them"}
    except RecursionError:
        return {"error": "messages: the model's chat template recursed too deeply rendering them"}
    except Exception as exc:  # noqa: BLE001 - whatever a checkpoint's template raises refuses only this request
        return {"error": f"messages: the model's chat template failed on them ({type(exc).__name__})"}
    if len(text) > MAX_RENDERED_CHARS:
        return {"error": f"messages: the model's chat template rendered {len(text)} characters; "
                         f"the limit is {MAX_RENDERED_CHARS}"}
    return {"text": text}


def main() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the server, which stops us
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    import coordinator.chat  # noqa: F401 - jinja2 loaded before the first request, not during it

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(frame({"ready": True}))
    stdout.flush()
    while (request := read_frame(stdin)) is not None:
        signal.alarm(math.ceil(request["timeout_s"]) + 2)  # the parent kills us first; this if it cannot
        reply = render(request)
        signal.alarm(0)
        stdout.write(frame(reply))
        stdout.flush()


if __name__ == "__main__":
    main()
