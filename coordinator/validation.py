"""Validation of a public GenerateRequest into the coordinator's plain ``GenerateParams``.

Every limit is checked here, at the edge, and a violation raises
:class:`~coordinator.errors.InvalidArgumentError` naming the field and the limit;
nothing past this point sees protobuf or unchecked input. No torch.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from coordinator.cache_isolation import prefix_cache_namespace
from coordinator.chat import ChatPrompt, encode_chat, tokenize_chat
from coordinator.errors import InvalidArgumentError, NotFoundError
from coordinator.grammar_compiler import GrammarCompiler
from coordinator.sampling_controls import field_value, validate_sampling_controls
from coordinator.structured_output import check_continuation
from coordinator.tokenizer import Tokenizer
from tpserve.step import SEED_MODULUS, SamplingParams
from tpserve.v1 import generate_pb2 as pb

MAX_REQUEST_ID_LEN = 128
MAX_CACHE_SALT_LEN = 256
#: Longest text prompt, in bytes of UTF-8 (1 MiB, about 250,000 tokens of English):
#: refused before tokenizing, which costs about 1 s per MiB (docs/design/faults.md, "Size caps").
MAX_PROMPT_TEXT_BYTES = 1024**2
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 64
DEFAULT_TEMPERATURE = 1.0
#: Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``): ``logits / 1e-5`` is
#: already one-hot after softmax, and smaller ones (down to float32's 1e-45) make
#: ``logits / temperature`` overflow to inf and softmax to NaN (docs/design/sampling.md, "Tiny temperatures are
#: greedy").
MIN_SAMPLING_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class GenerateParams:
    """A validated request.

    Attributes:
        request_id: caller's id or "" (the engine assigns one).
        prompt_token_ids: 1 to max_model_len - 1 tokens.
        max_tokens: most tokens to generate, >= 1 (already capped to the context).
        sampling: the worker's sampling parameters (seed drawn when unset).
        stop: stop strings.
        stop_token_ids: stop token ids.
        ignore_eos: keep going after eos.
        include_stop_str_in_output: keep a matched stop string at the end of the text.
        cache_namespace: the prefix-cache namespace of the caller's tenant and
            ``cache_salt`` (:mod:`coordinator.cache_isolation`).
        priority: queue order, lower first (:class:`coordinator.sequence.Sequence`).
        tenant: the caller's tenant id ("" without API keys): whose Abort may end it.
        generated_token_ids: a continued request's earlier output (the request's
            ``generated_token_ids``): fewer than ``max_tokens``, no stop token among them,
            allowed by the request's grammar if it has one (usage counts them as prompt tokens).
        lora_slot: the resident slot of the request's ``lora_name`` (``--lora-modules`` order, from 1); 0: none.
        lora_name: the request's adapter, ``""`` for the base model (the metrics' ``lora_name`` label).
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    include_stop_str_in_output: bool = False
    cache_namespace: bytes = b""
    priority: int = 0
    tenant: str = ""
    generated_token_ids: tuple[int, ...] = ()
    lora_slot: int = 0
    lora_name: str = ""


def validate_request(request: pb.GenerateRequest, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                     tenant: str = "", chat: tuple[ChatPrompt, str] | None = None,
                     grammars: GrammarCompiler | None = None,
                     lora_slots: Mapping[str, int] | None = None, lora_key: str | None = None) -> GenerateParams:
    """Checks a request and tokenizes its prompt (blocking: about 1 s for a 1 MiB prompt; the
    server runs it off its event loop).

    Args:
        request: the public request.
        tokenizer: the model's tokenizer (for a text prompt).
        vocab_size: the model's vocabulary size: token ids must be in [0, vocab_size).
        max_model_len: longest sequence in tokens.
        tenant: the caller's tenant id (:func:`coordinator.cache_isolation.tenant_id`),
            ``""`` when API keys are off.
        chat: for a chat request, its prepared messages and their rendered text
            (:class:`coordinator.chat_renderer.ChatRenderPool`); None renders them here.
        grammars: compiles a response_format in child processes under a time limit
            (the server's); None compiles on this thread (tests, tools).
        lora_slots: ``--enable-lora``'s adapter names and their slots; None or empty: no adapters.
        lora_key: the adapter's prefix-cache identity for this load (coordinator/lora_registry.py:
            a reloaded adapter gets a new one); None: its name.

    Raises:
        InvalidArgumentError: a field is missing or out of range; the message names it.
        NotFoundError: ``lora_name`` names no adapter the server was started with.
    """
    lora_slot = _lora_slot(request, lora_slots or {})
    if len(request.request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidArgumentError(f"request_id is {len(request.request_id)} characters; the limit is {MAX_REQUEST_ID_LEN}")
    if request.HasField("cache_salt") and not 1 <= len(request.cache_salt) <= MAX_CACHE_SALT_LEN:
        raise InvalidArgumentError(f"cache_salt is {len(request.cache_salt)} characters; "
                                   f"it must have 1 to {MAX_CACHE_SALT_LEN}")
    prompt_token_ids = _prompt_token_ids(request, tokenizer, vocab_size, max_model_len, chat)
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidArgumentError(
            f"prompt is {len(prompt_token_ids)} tokens; it must be shorter than max_model_len={max_model_len}")

    params = request.sampling_params
    room = max_model_len - len(prompt_token_ids)
    max_tokens = field_value(params, "max_tokens")  # ranges: tpserve/sampling_fields.py
    max_tokens = room if max_tokens is None else min(max_tokens, room)
    min_tokens = params.min_tokens  # its range: validate_sampling_controls, below
    if min_tokens > room:  # the context's room bounds it, not a max_tokens never sent
        raise InvalidArgumentError(
            f"sampling_params.min_tokens={min_tokens} exceeds the prompt's room in the context: max_model_len="
            f"{max_model_len} less the prompt's {len(prompt_token_ids)} tokens leaves {room}")
    temperature = field_value(params, "temperature")
    if temperature < MIN_SAMPLING_TEMPERATURE:
        temperature = 0.0  # greedy: the same tokens as temperature 0, never an overflowed softmax
    top_k, top_p = max(field_value(params, "top_k"), 0), field_value(params, "top_p")  # -1: vLLM's "all", as 0
    seed = field_value(params, "seed")
    seed = random.randrange(SEED_MODULUS) if seed is None else seed

    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidArgumentError(f"sampling_params.stop has {len(params.stop)} strings; the limit is {MAX_STOP_STRINGS}")
    for stop in params.stop:
        if not 1 <= len(stop) <= MAX_STOP_STRING_LEN:
            raise InvalidArgumentError(
                f"sampling_params.stop strings must be 1 to {MAX_STOP_STRING_LEN} characters, got {len(stop)}")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgumentError(
            f"sampling_params.stop_token_ids has {len(params.stop_token_ids)} ids; the limit is {MAX_STOP_TOKEN_IDS}")
    _check_token_ids("sampling_params.stop_token_ids", params.stop_token_ids, vocab_size)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eos_token_ids))
    generated = _generated_token_ids(request, vocab_size, max_tokens, stop_ids)
    controls = validate_sampling_controls(params, vocab_size, max_tokens, stop_ids, grammars)  # min_p, penalties, ...
    if generated and controls["grammar"]:  # checked like output: the server continues it as its own
        check_continuation(params.response_format, controls["grammar"], generated, tokenizer, vocab_size, grammars)

    return GenerateParams(
        request_id=request.request_id,
        prompt_token_ids=prompt_token_ids,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, **controls),
        stop=tuple(params.stop),
        stop_token_ids=frozenset(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        cache_namespace=prefix_cache_namespace(tenant, request.cache_salt, lora_key or request.lora_name),
        lora_slot=lora_slot,
        lora_name=request.lora_name if lora_slot else "",
        priority=request.priority,
        tenant=tenant,
        generated_token_ids=generated,
    )


def _lora_slot(request: pb.GenerateRequest, lora_slots: Mapping[str, int]) -> int:
    """The slot of the request's ``lora_name``; 0 when unset or empty (the base model)."""
    if not request.lora_name:
        return 0
    slot = lora_slots.get(request.lora_name)
    if slot is None:
        served = ", ".join(sorted(lora_slots)) or "none (start the server with --enable-lora --lora-modules)"
        raise NotFoundError(f"lora_name {request.lora_name!r} is not a served adapter; served: {served}")
    return slot


def _generated_token_ids(request: pb.GenerateRequest, vocab_size: int, max_tokens: int,
                         stop_ids: set[int]) -> tuple[int, ...]:
    """A continued request's earlier output (proto: ``generated_token_ids``): fewer than
    ``max_tokens`` (the uninterrupted request would have finished), no stop token (never
    delivered), and one sample only (each sample of ``n`` has its own output)."""
    ids = request.generated_token_ids
    if not ids:
        return ()
    if request.sampling_params.HasField("n") and request.sampling_params.n > 1:
        raise InvalidArgumentError("generated_token_ids continues one completion; it needs sampling_params.n = 1, "
                                   f"got {request.sampling_params.n}")
    if len(ids) >= max_tokens:
        raise InvalidArgumentError(f"generated_token_ids has {len(ids)} tokens; a continued request has fewer than "
                                   f"max_tokens={max_tokens} (the prompt's room in the context included)")
    _check_token_ids("generated_token_ids", ids, vocab_size)
    stops = stop_ids.intersection(ids)
    if stops:
        raise InvalidArgumentError(f"generated_token_ids contains the stop token {min(stops)}, which ends a "
                                   "completion and is never delivered")
    return tuple(ids)


def _prompt_token_ids(request: pb.GenerateRequest, tokenizer: Tokenizer, vocab_size: int,
                      max_model_len: int, chat: tuple[ChatPrompt, str] | None) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        if not request.text:
            raise InvalidArgumentError("prompt text is empty; it must have at least 1 character")
        # len(text) <= bytes <= 4 * len(text): encode only when the count could be over.
        if len(request.text) * 4 > MAX_PROMPT_TEXT_BYTES and len(request.text.encode()) > MAX_PROMPT_TEXT_BYTES:
            raise InvalidArgumentError(f"prompt text is {len(request.text.encode())} bytes of UTF-8; "
                                       f"the limit is {MAX_PROMPT_TEXT_BYTES}")
        ids = tokenizer.encode(request.text, parse_special_tokens=request.parse_special_tokens)
        if not ids:  # a normalizer may remove every character, and a tokenizer may add no bos
            raise InvalidArgumentError("prompt text encodes to no tokens; it must have at least 1")
        _check_encoded("prompt text", ids, vocab_size)
        return ids
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidArgumentError("prompt token_ids is empty; it must have at least 1 token")
        if len(ids) >= max_model_len:  # before the per-id check: a long list costs time
            raise InvalidArgumentError(
                f"prompt is {len(ids)} tokens; it must be shorter than max_model_len={max_model_len}")
        _check_token_ids("prompt token_ids", ids, vocab_size)
        return ids
    if kind == "messages":
        if chat is None:  # rendered here, without the server's bounds (tests, tools)
            ids = encode_chat(tokenizer, chat_messages(request))
        else:
            ids = tokenize_chat(tokenizer, *chat)
        if not ids:  # a template may render nothing for these messages: a 0-token prompt would fail the ranks
            raise InvalidArgumentError("messages render to an empty prompt (the chat template wrote no text for "
                                       "them, and the tokenizer adds no bos); send a message the template renders")
        _check_encoded("messages", ids, vocab_size)
        return ids
    raise InvalidArgumentError("prompt is missing: set text, token_ids or messages")


def _check_encoded(field: str, ids: list[int], vocab_size: int) -> None:
    """A tokenizer with more tokens than the model's embedding would crash the ranks' lookup."""
    if ids and max(ids) >= vocab_size:
        raise InvalidArgumentError(f"{field} encodes to token id {max(ids)}, outside the model's vocabulary "
                                   f"[0, {vocab_size}): the tokenizer has more tokens than the model")


def _check_token_ids(field: str, ids, vocab_size: int) -> None:
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise InvalidArgumentError(f"{field} contains {token_id}; token ids must be in [0, {vocab_size})")


def chat_messages(request: pb.GenerateRequest) -> list[dict[str, str]]:
    """A chat request's messages as ``{"role", "content"}`` dicts (checked by :func:`coordinator.chat.prepare_chat`)."""
    return [{"role": m.role, "content": m.content} for m in request.messages.messages]
