"""Requests holding a string that is not UTF-8: which field, so a batch keeps its other items.

protobuf refuses a whole message when one of its `string` fields holds bytes that
are not UTF-8, and does not say which field. Python's and Go's libraries refuse
to encode such a string, but a C++ client checks only in debug builds, so a text
read from a Latin-1 file reaches the server as sent: one such item of a
ClassifyBatch failed the other 1,023 items with it, as `wire_format` and no field.

A request that does not decode is read again as its *bytes mirror*: the same
message type with every `string` field declared `bytes` (the same field numbers,
so the same wire format), which takes any bytes. Each string that is not UTF-8 is
named by its path (`items[3].text`) and replaced by its UTF-8 reading with U+FFFD
for what is not, and the repaired bytes decode as the real type. The caller
decides what the paths mean (the lifecycle, classify_common.interceptor: a
batch's broken items are refused on their own, anything else refuses the call).
Map fields keep their types (a map key may not be `bytes`): a bad string inside
one still leaves the request undecodable.

Only a request that failed to decode pays for any of this.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor
from google.protobuf.message import DecodeError, Message

from classify_common.errors import FieldViolation

# The rule a string that is not UTF-8 breaks (protovalidate has none: protobuf's
# decoder enforces it before any rule is read).
UTF8_RULE = "utf8"


@dataclass(frozen=True)
class NotUtf8:
    """One string field of a request whose bytes are not UTF-8."""

    # Its path as validation names fields: `items[3].text`.
    field: str
    # The first byte that is not UTF-8, and its offset within the field's bytes.
    byte: int
    offset: int

    def violation(self) -> FieldViolation:
        return FieldViolation(
            field=self.field,
            rule=UTF8_RULE,
            message=f"must be UTF-8 (byte {self.byte:#04x} at offset {self.offset} is not)",
        )


def read_with_bad_strings(
    message_class: type[Message], raw: bytes, *, most_elements: int
) -> tuple[Message, list[NotUtf8]] | None:
    """`raw`, which did not decode as `message_class`, read with its strings that are
    not UTF-8 repaired, and those strings; None when it does not decode even so (not a
    message of the type, or a bad string inside a map), or when a repeated field holds
    more than `most_elements` (walking each of a million tiny items would hold the
    event loop for a second, for a request its size rules refuse anyway)."""
    mirror_class, was_string = _bytes_mirror(message_class.DESCRIPTOR)
    try:
        mirror = mirror_class.FromString(raw)
        bad = list(_repair(mirror, "", was_string, most_elements))
    except (DecodeError, _TooManyElements):
        return None
    if not bad:
        return None
    try:
        return message_class.FromString(mirror.SerializeToString()), bad
    except DecodeError:
        return None


class _TooManyElements(Exception):
    pass


def _repair(
    message: Message, prefix: str, was_string: frozenset[str], most_elements: int
) -> Iterator[NotUtf8]:
    """Replace, in `message` (a bytes mirror), each former string that is not UTF-8 by
    its UTF-8 reading, and yield where each was."""
    for field, value in message.ListFields():
        path = f"{prefix}{field.name}"
        if field.is_repeated and len(value) > most_elements:
            raise _TooManyElements(path)
        if field.full_name in was_string:
            if field.is_repeated:
                for index, element in enumerate(value):
                    found = _not_utf8(f"{path}[{index}]", element)
                    if found is not None:
                        value[index] = _repaired(element)
                        yield found
            else:
                found = _not_utf8(path, value)
                if found is not None:
                    setattr(message, field.name, _repaired(value))
                    yield found
        elif field.type == FieldDescriptor.TYPE_MESSAGE and not _is_map(field):
            if field.is_repeated:
                for index, element in enumerate(value):
                    yield from _repair(element, f"{path}[{index}].", was_string, most_elements)
            else:
                yield from _repair(value, f"{path}.", was_string, most_elements)


def _not_utf8(path: str, value: bytes) -> NotUtf8 | None:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError as error:
        return NotUtf8(path, value[error.start], error.start)
    return None


def _repaired(value: bytes) -> bytes:
    return value.decode("utf-8", "replace").encode("utf-8")


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


@functools.cache
def _bytes_mirror(descriptor: Descriptor) -> tuple[type[Message], frozenset[str]]:
    """The class of `descriptor`'s bytes mirror, in a descriptor pool of its own, and
    the full names of the fields it turned from string to bytes: those of the message
    types a request of `descriptor` can hold (its own, its fields' and theirs)."""
    reachable = _message_types_within(descriptor, set())
    pool = descriptor_pool.DescriptorPool()
    was_string: set[str] = set()
    added: set[str] = set()

    def add(file: FileDescriptor) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        for message in proto.message_type:
            _strings_to_bytes(message, proto.package, reachable, was_string)
        pool.Add(proto)
        added.add(file.name)

    add(descriptor.file)
    mirror = pool.FindMessageTypeByName(descriptor.full_name)
    return message_factory.GetMessageClass(mirror), frozenset(was_string)


def _message_types_within(descriptor: Descriptor, found: set[str]) -> set[str]:
    """The full names of `descriptor` and of every message type its fields can hold,
    map entries left out."""
    if descriptor.full_name in found or descriptor.GetOptions().map_entry:
        return found
    found.add(descriptor.full_name)
    for field in descriptor.fields:
        if field.message_type is not None:
            _message_types_within(field.message_type, found)
    return found


def _strings_to_bytes(
    message: descriptor_pb2.DescriptorProto,
    scope: str,
    reachable: set[str],
    was_string: set[str],
) -> None:
    full_name = f"{scope}.{message.name}" if scope else message.name
    if full_name in reachable:
        for field in message.field:
            if field.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                # Rules for strings mean nothing on bytes; the mirror is never validated.
                field.ClearField("options")
                was_string.add(f"{full_name}.{field.name}")
    for nested in message.nested_type:
        _strings_to_bytes(nested, full_name, reachable, was_string)
