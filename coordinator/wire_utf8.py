"""Which string field of an undecodable request holds bad UTF-8.

protobuf refuses a message whose ``string`` field is not UTF-8 (proto3 requires it) with
``String field had bad UTF-8`` and no field name. A client in a language whose strings are
bytes (Go, C++) sends one by mistake; the answer should say which field to fix. This walks
the protocol buffers wire format (https://protobuf.dev/programming-guides/encoding/) of the
raw request against the message's descriptor, and names the first string field whose bytes
do not decode, as a dotted path (``sampling_params.stop``). Only the coordinator's error path
calls it, on a request that already failed to decode.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

#: Deepest message nesting walked; a request is a few levels deep, and garbage must not recurse forever.
_MAX_DEPTH = 16


def invalid_utf8_field(descriptor: Descriptor, data: bytes, _depth: int = 0) -> str | None:
    """The dotted path of the first ``string`` field of ``data`` (a serialized ``descriptor`` message)
    that is not UTF-8, or None when there is none or the bytes are not walkable wire format."""
    try:
        return _walk(descriptor, memoryview(data), _depth)
    except (IndexError, ValueError):
        return None


def _walk(descriptor: Descriptor, data: memoryview, depth: int) -> str | None:
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _varint(data, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
            if pos > len(data):
                raise ValueError("truncated")
            field = descriptor.fields_by_number.get(number)
            found = _check_field(field, value, depth) if field is not None else None
            if found is not None:
                return found
        else:
            raise ValueError(f"wire type {wire_type}")
    return None


def _check_field(field: FieldDescriptor, value: memoryview, depth: int) -> str | None:
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            str(value, "utf-8")
        except UnicodeDecodeError:
            return field.name
        return None
    if field.type == FieldDescriptor.TYPE_MESSAGE and depth < _MAX_DEPTH:
        inner = _walk(field.message_type, value, depth + 1)
        if inner is None:
            return None
        if field.message_type.GetOptions().map_entry:  # a map<string, ...>: the entry's key or value is the map's
            return field.name
        return f"{field.name}.{inner}"
    return None


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    """The base-128 varint at ``pos`` and the position after it. Raises IndexError past the end."""
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")
