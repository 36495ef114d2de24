"""The sampling fields of a request, declared once: name, type, range, default, help and stage.

Everything else is derived from :data:`FIELDS` (docs/design/sampling.md, "Sampling controls"):

* the coordinator's checks of a public ``SamplingParams`` (:func:`check`, with the
  message ``sampling_params.<name> must be ...``, INVALID_ARGUMENT);
* the step protocol's :class:`tpserve.step.SamplingParams` (its fields and
  ``__post_init__`` checks) and its wire form (:mod:`tpserve.step_pb`);
* the Python client's keyword arguments (:mod:`tpserve.client`) and the CLI's
  ``tpserve generate`` flags (:mod:`tpserve.cli`, vLLM's names with dashes);
* on the worker, each ``stage="processor"`` field is read by one logits processor
  (worker/logits_processors.py), which declares its place in the order.

A new scalar control is one entry here, its field in proto/tpserve/v1/generate.proto
(public, ``optional``) and worker.proto (``WorkerSamplingParams``, same name), and
its processor. Fields whose checks need the request (``stop``, ``logit_bias``,
``response_format``) stay hand-written in coordinator/validation.py and
coordinator/sampling_controls.py. No torch: the coordinator imports this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

#: Where a field takes effect. ``coordinator``: the coordinator alone (stop conditions, n);
#: ``sampler``: the worker's sampler core (temperature, top-k, top-p, seed); ``processor``:
#: a worker logits processor; ``output``: what the worker reports (logprobs).
Stage = Literal["coordinator", "sampler", "processor", "output"]


@dataclass(frozen=True, slots=True)
class SamplingField:
    """One field of the public and the worker ``SamplingParams``.

    Attributes:
        name: the proto field's name (and the client's keyword, the step dataclass's
            attribute); the CLI flag is ``--`` + name with dashes.
        type: ``float``, ``int`` or ``bool`` (a scalar), ``list`` (repeated) or ``dict`` (a map).
        default: the server's value when the field is unset; for a processor, the
            value that disables it. None: no value (``max_tokens``: the context's room;
            ``seed``: random; ``prompt_logprobs``: off).
        help: one line for ``help()`` and ``--help``.
        stage: see :data:`Stage`.
        low, high: the range's bounds, None for none. NaN is never in range; an
            unbounded float must be finite.
        low_open, high_open: the bound itself is excluded.
        high_name: the upper bound is a value of the request (``max_tokens``), named
            in the message; :func:`check` takes it in ``bounds``.
        history: a processor that reads the sequence's earlier tokens (the worker then
            keeps its token history; speculation is off).
        needs: the field only acts when this other field is non-empty (``min_tokens``
            without stop ids does nothing).
        items: a repeated field's item type (a map's: ``(key, value)``).
        flag_name: the CLI flag when not ``--`` + name with dashes ("" for none).
        cli: whether ``tpserve generate`` has a flag for it.
    """

    name: str
    type: type
    default: object
    help: str
    stage: Stage
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    high_name: str = ""
    history: bool = False
    needs: str = ""
    items: object = None
    flag_name: str = ""
    cli: bool = True

    @property
    def flag(self) -> str:
        """The ``tpserve generate`` flag (vLLM's spelling)."""
        return self.flag_name or "--" + self.name.replace("_", "-")

    @property
    def on_worker(self) -> bool:
        """Whether the worker's step protocol carries the field."""
        return self.stage != "coordinator"

    def range_text(self, bounds: dict[str, float] | None = None) -> str:
        """The range in words: ``in [0, 1]``, ``in (0, 1]``, ``a finite number > 0``, ``>= 1``."""
        high = self._high(bounds)
        high_text = f"{self.high_name}={_num(high)}" if self.high_name else _num(high)
        if self.low is not None and high is not None:
            return f"in {'(' if self.low_open else '['}{_num(self.low)}, {high_text}{')' if self.high_open else ']'}"
        finite = "a finite number " if self.type is float else ""
        if self.low is not None:
            note = f" ({_num(self.default)} disables it)" if self.stage == "processor" else ""
            return f"{finite}{'>' if self.low_open else '>='} {_num(self.low)}{note}"
        return f"{finite}{'<' if self.high_open else '<='} {_num(high)}" if high is not None else "any value"

    def _high(self, bounds: dict[str, float] | None) -> float | None:
        """The upper bound; a request's value (``high_name``) is None (no bound) when not given."""
        return (bounds or {}).get(self.high_name) if self.high_name else self.high

    def in_range(self, value: float, bounds: dict[str, float] | None = None) -> bool:
        """Whether ``value`` is in the range (False for NaN and, for a float, infinities)."""
        if self.type is float and not math.isfinite(value):
            return False
        high = self._high(bounds)
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return high is None or (value < high if self.high_open else value <= high)


def _num(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


#: Unsigned 64-bit range of a sampling seed.
SEED_MODULUS = 1 << 64
#: Most ``top_logprobs`` and ``prompt_logprobs`` a request may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
#: Most completions of one request (``n``).
MAX_N = 16

FIELDS: tuple[SamplingField, ...] = (
    SamplingField("max_tokens", int, None, "most tokens to generate (default: as many as fit in the context)",
                  "coordinator", low=1),
    SamplingField("temperature", float, 1.0, "softmax temperature; 0 is greedy (default 1.0)", "sampler", low=0),
    SamplingField("top_k", int, 0, "sample among the K most likely tokens; 0 or -1 (vLLM's) keeps all (default 0)",
                  "sampler", low=-1),
    SamplingField("top_p", float, 1.0, "nucleus sampling: the most likely tokens whose probabilities add up to P "
                  "(default 1.0: all)", "sampler", low=0, high=1, low_open=True),
    SamplingField("seed", int, None, "seeds the sampling: the same seed and prompt give the same text "
                  "(default: random)", "sampler", low=0, high=SEED_MODULUS, high_open=True),
    SamplingField("stop", list, (), "stop string: the completion ends before it (repeatable)", "coordinator",
                  items=str),
    SamplingField("stop_token_ids", list, (), "stop at this token id (repeatable)", "coordinator", items=int,
                  flag_name="--stop-token-id"),
    SamplingField("ignore_eos", bool, False, "keep generating past the end-of-sequence token", "coordinator"),
    SamplingField("min_p", float, 0.0, "drop tokens less likely than this share of the most likely one "
                  "(default 0: off)", "processor", low=0, high=1),
    SamplingField("typical_p", float, 1.0, "locally typical sampling: the tokens nearest the entropy, up to this "
                  "probability (default 1.0: off)", "processor", low=0, high=1, low_open=True),
    SamplingField("repetition_penalty", float, 1.0, "> 1 discourages tokens of the prompt and the output "
                  "(default 1: off)", "processor", low=0, low_open=True, history=True),
    SamplingField("presence_penalty", float, 0.0, "in [-2, 2], subtracted once from output tokens' logits",
                  "processor", low=-2, high=2, history=True),
    SamplingField("frequency_penalty", float, 0.0, "in [-2, 2], subtracted per occurrence in the output",
                  "processor", low=-2, high=2, history=True),
    SamplingField("logit_bias", dict, (), "add BIAS in [-100, 100] to the token's logit (repeatable)", "processor",
                  items=(int, float)),
    SamplingField("min_tokens", int, 0, "no end-of-sequence, stop token id or stop string before this many tokens",
                  "processor", low=0, high_name="max_tokens", needs="min_tokens_stop_ids"),
    SamplingField("include_stop_str_in_output", bool, False, "keep a matched stop string in the text", "coordinator"),
    SamplingField("logprobs", bool, False, "each token's log-probability (raw distribution)", "output"),
    SamplingField("top_logprobs", int, 0, "with logprobs: the N most likely tokens too (0..20)", "output",
                  low=0, high=MAX_TOP_LOGPROBS),
    SamplingField("prompt_logprobs", int, None, "each prompt token's log-probability and the N most likely "
                  "(0..20)", "output", low=0, high=MAX_TOP_LOGPROBS),
    SamplingField("n", int, 1, "completions to generate from the prompt (1..16)", "coordinator", low=1, high=MAX_N,
                  cli=False),  # the CLI prints one completion
)

FIELDS_BY_NAME: dict[str, SamplingField] = {f.name: f for f in FIELDS}

#: The integer range of each protobuf scalar type a sampling field may have on the wire
#: (proto/tpserve/v1/generate.proto): a value outside it cannot be sent at all.
WIRE_RANGES: dict[str, tuple[int, int]] = {
    "int32": (-(2**31), 2**31 - 1), "uint32": (0, 2**32 - 1),
    "int64": (-(2**63), 2**63 - 1), "uint64": (0, 2**64 - 1),
}


def check_value(spec: SamplingField, value: float, wire_type: str = "") -> str | None:
    """What is wrong with a client-side ``value`` for ``spec``, or None when it may be sent.

    An integer field's range is its own range within its wire type's (``wire_type``: the proto scalar,
    e.g. ``"int32"``): ``max_tokens`` is ``[1, 2147483647]``, ``seed`` ``[0, 18446744073709551615]``.
    The request's own bounds (``min_tokens <= max_tokens``) are the server's to check.

    Returns:
        ``"must be in [1, 2147483647], got 10000000000"``, or None.
    """
    wire = WIRE_RANGES.get(wire_type)
    if spec.type is float or wire is None:
        return None if spec.in_range(value) else f"must be {spec.range_text()}, got {_num(value)}"
    low = wire[0] if spec.low is None else max(wire[0], int(spec.low) + spec.low_open)
    high = wire[1] if spec.high is None or spec.high_name else min(wire[1], int(spec.high) - spec.high_open)
    return None if low <= value <= high else f"must be in [{low}, {high}], got {value}"


def check(name: str, value: float, prefix: str = "", bounds: dict[str, float] | None = None) -> None:
    """Raises ``ValueError(f"{prefix}{name} must be {range}, got {value}")`` unless ``value`` is in range.

    Args:
        name: a field of :data:`FIELDS` with a range.
        value: the value to check.
        prefix: prepended to the name in the message (``"sampling_params."``).
        bounds: values of the request a bound names (``{"max_tokens": 7}``).

    Raises:
        ValueError: out of range; the coordinator turns it into INVALID_ARGUMENT.
    """
    spec = FIELDS_BY_NAME[name]
    if not spec.in_range(value, bounds):
        raise ValueError(f"{prefix}{name} must be {spec.range_text(bounds)}, got {value}")
