"""JSON schemas that are expensive to compile, shared by the structured-output limit tests."""

from __future__ import annotations


def deep_any_of(depth: int) -> dict:
    """``anyOf`` nested ``depth`` deep (4 JSON levels each): the issue's hostile schema at 200 (about 12 KB)."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"anyOf": [{"type": "string"}, {"type": "object", "properties": {"a": schema}}]}
    return schema


def multiplying_all_of(num: int) -> dict:
    """``allOf`` of ``num`` two-way ``anyOf``s: 2**num alternatives. Built in about 0.25 s at 10 on a quiet host
    (AVX-512, llguidance 1.x); at 11 llguidance refuses it (a grammar-size assertion) after about 0.5 s."""
    return {"allOf": [{"anyOf": [
        {"type": "object", "properties": {f"a{i}": {"type": "integer"}}, "required": [f"a{i}"]},
        {"type": "object", "properties": {f"b{i}": {"type": "string"}}, "required": [f"b{i}"]}]} for i in range(num)]}
