"""Request messages decoded in the ingress, so an undecodable one is INVALID_ARGUMENT, not UNKNOWN.

The servicers registered on Serve's gRPC proxy (`protos.add_*_to_server`) pass request bytes
through undecoded; decoding here turns protobuf's `DecodeError` (invalid UTF-8 in a string,
a truncated message, field number 0) into a refusal that names the field at fault. Protobuf's
own error names only the message type, so a short walk over the wire format finds the field.
"""

from typing import Any, TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from ddtree_serve.serve.errors import RequestError, invalid

MessageT = TypeVar("MessageT", bound=Message)

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5
_ONE_PER_ELEMENT = (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)

NO_FAULT_FOUND = "not a valid protobuf encoding"
"""The walk's verdict on bytes it finds no fault in: of bytes protobuf refused, all it can say."""

MAX_NESTING = 100
"""Messages within messages the walk follows: protobuf's own default recursion limit, past which
it refuses a message however valid its bytes (a `google.protobuf.Struct` nested a few hundred
levels, a few KB). Unbounded, the walk went one Python frame deeper a level and ended in a
`RecursionError`: an internal error where the client sent a bad message."""


def decode(message_class: type[MessageT], data: bytes | MessageT) -> MessageT:
    """`data` parsed as `message_class`; a message already decoded (a handle call) is returned."""
    if isinstance(data, message_class):
        return data
    try:
        message = message_class.FromString(bytes(data))
    except DecodeError:
        raise undecodable(message_class.DESCRIPTOR, bytes(data)) from None
    if data and not message_class.DESCRIPTOR.fields:
        # protobuf (upb) parses a message without fields unchecked: field number 0 passes there.
        problem, field = _wire_problem(message_class.DESCRIPTOR, bytes(data), "")
        if problem != NO_FAULT_FOUND:
            raise invalid(f"undecodable {message_class.DESCRIPTOR.full_name} message: {problem}", field)
    return message


def undecodable(descriptor: Descriptor, data: bytes) -> RequestError:
    problem, field = _wire_problem(descriptor, data, "")
    return invalid(f"undecodable {descriptor.full_name} message: {problem}", field)


class _Truncated(Exception):
    pass


def _wire_problem(descriptor: Descriptor, data: bytes, path: str, depth: int = 0) -> tuple[str, str | None]:
    """The first thing in `data` that protobuf refuses, and the dotted field path where it is;
    `depth`: the messages `data` is nested in."""
    if depth > MAX_NESTING:
        outermost = path.split(".")[0]
        return f"field `{outermost}` nests messages more than {MAX_NESTING} deep", outermost
    position, seen, name = 0, dict[int, int](), path
    try:
        while position < len(data):
            key, position = _varint(data, position)
            number, wire_type = key >> 3, key & 7
            if number == 0:
                return "field number 0 is not allowed", path or None
            field = descriptor.fields_by_number.get(number)
            name = _field_name(path, field, number, seen)
            if wire_type == _VARINT:
                _, position = _varint(data, position)
            elif wire_type in (_FIXED64, _FIXED32):
                position += 8 if wire_type == _FIXED64 else 4
            elif wire_type == _LENGTH_DELIMITED:
                length, position = _varint(data, position)
                payload = data[position : position + length]
                position += length
                if position > len(data):
                    raise _Truncated
                if problem := _payload_problem(field, payload, name, depth):
                    return problem
            else:
                return f"wire type {wire_type} is not supported", name
            if position > len(data):
                raise _Truncated
    except _Truncated:
        return (f"the message is truncated (in field `{name}`)" if name else "the message is truncated"), (
            name or None
        )
    return NO_FAULT_FOUND, path or None


def _payload_problem(
    field: FieldDescriptor | None, payload: bytes, name: str, depth: int
) -> tuple[str, str] | None:
    if field is None:
        return None  # an unknown field is kept as bytes: nothing to check
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            payload.decode("utf-8")
        except UnicodeDecodeError as error:
            return f"field `{name}` is not valid UTF-8 (byte {error.start})", name
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        problem, where = _wire_problem(field.message_type, payload, name, depth + 1)
        if problem != NO_FAULT_FOUND:
            return problem, where or name
    return None


def _field_name(path: str, field: FieldDescriptor | None, number: int, seen: dict[int, int]) -> str:
    """`messages[1].content`-style names: repeated messages and strings are indexed in order of
    appearance (a packed repeated number is one blob, named without an index)."""
    name = field.name if field is not None else f"#{number}"
    if field is not None and _is_repeated(field) and field.type in _ONE_PER_ELEMENT:
        index = seen.get(number, 0)
        seen[number] = index + 1
        name = f"{name}[{index}]"
    return f"{path}.{name}" if path else name


def _is_repeated(field: Any) -> bool:
    # protobuf >= 5 has `is_repeated`; older releases only `label`.
    is_repeated = getattr(field, "is_repeated", None)
    return bool(is_repeated) if is_repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if position >= len(data):
            raise _Truncated
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
