"""Who may share prefix-cache entries: the caller's tenant and the request's ``cache_salt``.

A shared prefix cache is an oracle: a request that finds another request's blocks is
served faster (time to first token) and reports them (``cached_prompt_tokens``), so a
caller could test, block by block, guesses about someone else's prompt (vLLM's
CVE-2025-46570). So each request has a *namespace*, the digest of

- its tenant: with API keys on, an id derived from the key it authenticated with
  (:func:`tenant_id`; never the key itself), else ``""`` (one anonymous tenant);
- its ``cache_salt`` (the request field, ``""`` when unset),

and block 0 of its sequence chains from that namespace instead of from nothing
(:func:`coordinator.kv_cache_manager.extend_block_hashes`): every block hash of the chain then
differs between namespaces, so a request can only ever find blocks that requests of its
own namespace computed (vLLM's ``cache_salt`` does the same to the first block). The
default namespace (anonymous, no salt) is ``b""``, the unsalted chain.

No torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Sequence

#: Keyed so that a tenant id reveals nothing about its key, even a short one; per process,
#: which is all the cache needs (its blocks do not outlive the process either).
_TENANT_KEY = secrets.token_bytes(32)
#: Domain separation: a namespace digest can never equal a block hash (whose input is a
#: 32-byte hash or int64 token ids, not this text), so no salt can be chosen to continue
#: someone else's chain.
_NAMESPACE_PREFIX = b"tpserve prefix-cache namespace\x00"


def share_tenant_key(secret: str) -> None:
    """Derives the tenant-id key from the cluster ``secret`` instead of a per-process random one, so that
    every replica sharing the secret gives a tenant the same id, hence the same namespace: a KV
    transfer's blocks (coordinator/kv_transfer/) pass the receiver's namespace check only then.
    Called once at start-up, before any request."""
    global _TENANT_KEY
    _TENANT_KEY = hmac.new(secret.encode(), b"tpserve tenant-id key", hashlib.sha256).digest()


def tenant_id(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The tenant of an authenticated call: a keyed hash (16 hex digits) of its bearer key.

    Only meaningful once the API-key check (:class:`coordinator.auth.ApiKeyInterceptor`)
    accepted the call; the scheme's case and surrounding spaces do not matter.

    Args:
        metadata: the call's invocation metadata.

    Returns:
        The id, or ``""`` when the call carries no ``authorization`` bearer key.
    """
    for name, value in metadata or ():
        if name != "authorization":
            continue
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        scheme, _, key = text.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            return ""
        return hmac.new(_TENANT_KEY, key.encode(), hashlib.sha256).hexdigest()[:16]
    return ""


def prefix_cache_namespace(tenant: str, cache_salt: str, lora_name: str = "") -> bytes:
    """The 32-byte namespace block 0 chains from, or ``b""`` for the anonymous, unsalted base model.

    Args:
        tenant: :func:`tenant_id` of the caller, ``""`` when API keys are off.
        cache_salt: the request's ``cache_salt``, ``""`` when unset.
        lora_name: the request's LoRA adapter (``lora_name``), ``""`` for the base model: the
            adapter changes every layer's keys and values, so a block computed under one adapter
            must never be a hit for another or for the base model.
    """
    if not tenant and not cache_salt and not lora_name:
        return b""
    # JSON keeps ("ab", "c") and ("a", "bc") apart; without an adapter the digest is the one it always was.
    key = [tenant, cache_salt, lora_name] if lora_name else [tenant, cache_salt]
    return hashlib.sha256(_NAMESPACE_PREFIX + json.dumps(key).encode()).digest()
