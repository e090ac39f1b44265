"""Request validation: the contract's protovalidate rules, turned into InvalidRequest."""

from __future__ import annotations

import protovalidate
from google.protobuf.message import Message

from classify_common.errors import FieldViolation, InvalidRequest

# A Validator caches compiled rules per message type; one per process.
_validator = protovalidate.Validator()


def field_path_to_string(path: protovalidate.FieldPathPb | None) -> str:
    """Render a protovalidate field path the way a user writes it: `labels[2].name`.

    A rule on the whole message has no path; it is reported as the empty field.
    """
    if path is None:
        return ""
    parts: list[str] = []
    for element in path.elements:
        text = element.field_name
        subscript = element.subscript
        # The subscript is a oneof (index / bool_key / int_key / uint_key /
        # string_key); only one of them is set when the element is a list or map.
        if subscript is not None:
            key = subscript.value
            text += f'["{key}"]' if isinstance(key, str) else f"[{key}]"
        parts.append(text)
    return ".".join(parts)


def validate_request(message: Message) -> None:
    """Raise InvalidRequest with one FieldViolation per broken rule, or return."""
    violations = _validator.collect_violations(message)
    if violations:
        raise InvalidRequest(
            [
                FieldViolation(
                    field=field_path_to_string(v.proto.field),
                    rule=v.proto.rule_id,
                    message=v.proto.message,
                )
                for v in violations
            ]
        )
