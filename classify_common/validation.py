"""Request validation: the contract's protovalidate rules, turned into InvalidRequest."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import protovalidate
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import Message

from classify_common.errors import FieldViolation, InvalidRequest, ServiceError
from classify_common.intake import MAX_BATCH_ITEMS, MAX_BATCH_TOTAL_CHARS

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


def _collect(message: Message) -> list[FieldViolation]:
    return [
        FieldViolation(
            field=field_path_to_string(v.proto.field) or _field_named_by(v.proto.rule_id, message),
            rule=v.proto.rule_id,
            message=v.proto.message,
        )
        for v in _validator.collect_violations(message)
    ]


def _field_named_by(rule_id: str, message: Message) -> str:
    """The field a rule on the whole message checks, as its ID names it first
    (`item_contexts.count` checks `item_contexts`: a rule comparing two fields can only
    be set on their message, which protovalidate reports with no field); "" when the
    ID names none of the message's fields."""
    named = rule_id.partition(".")[0]
    return named if named in message.DESCRIPTOR.fields_by_name else ""


def compile_rules(service_names: Sequence[str]) -> list[str]:
    """Compile now the rules of every request type the named services take; the
    types' full names.

    protovalidate compiles a message type's rules at its first check, on the event
    loop: the first Classify a freshly started server took spent 24 ms validating in
    the orchestrator and 50 ms receiving in the capability (10 ms alone on an idle
    core), and every call that arrived meanwhile waited behind it, which is how a new
    replica put behind a busy load balancer begins. Called before a server turns
    SERVING."""
    pool = descriptor_pool.Default()
    compiled: list[str] = []
    for name in service_names:
        for method in pool.FindServiceByName(name).methods:
            request_type = message_factory.GetMessageClass(method.input_type)
            _validator.collect_violations(request_type())
            compiled.append(method.input_type.full_name)
    return compiled


def validate_request(message: Message) -> None:
    """Raise InvalidRequest with one FieldViolation per broken rule, or return."""
    violations = _collect(message)
    if violations:
        raise InvalidRequest(violations)


# `items[3].text` and `item_contexts[3].timeout` belong to item 3.
_ITEM_PATH = re.compile(r"^(?:items|item_contexts)\[(\d+)\](?:\.|$)")


def validate_batch(message: Message) -> dict[int, InvalidRequest]:
    """Check a batch request (a message with `repeated items`): raise InvalidRequest for
    the batch's own rules, and return the broken item rules by item index.

    Violations keep their full path (`items[3].text`), so a log line or a client that
    prints the error names the item without its position in the answer.

    The batch's size rules come first, before any item is looked at: under gRPC's
    8 MiB a call holds over a million tiny items, and checking each took 6 s of the
    event loop, every other caller's call waiting, to refuse the call anyway.
    """
    oversized = _oversized_batch(message)
    if oversized:
        raise InvalidRequest(oversized)
    by_item, whole = _split_by_item(_collect(message))
    if whole:
        raise InvalidRequest(whole)
    return by_item


def items_of(violations: Sequence[FieldViolation]) -> dict[int, InvalidRequest] | None:
    """A batch's `violations` as the refusals of the items they belong to, by index;
    None when one belongs to no item (the batch itself is broken)."""
    by_item, whole = _split_by_item(violations)
    return None if whole else by_item


def with_item_refusals(
    validated: Mapping[int, InvalidRequest], earlier: Mapping[int, ServiceError]
) -> dict[int, ServiceError]:
    """The items `validate_batch` refused, with those refused before it (`earlier`:
    strings that were not UTF-8, classify_common.utf8) refused for that too. A rule
    broken by such a string's stand-in (its U+FFFD) is left out: the caller did not
    send that text."""
    merged: dict[int, ServiceError] = dict(validated)
    for index, error in earlier.items():
        first = error.violations if isinstance(error, InvalidRequest) else ()
        named = {violation.field for violation in first}
        later = validated[index].violations if index in validated else ()
        others = [violation for violation in later if violation.field not in named]
        merged[index] = InvalidRequest([*first, *others]) if first else error
    return merged


def _split_by_item(
    violations: Sequence[FieldViolation],
) -> tuple[dict[int, InvalidRequest], list[FieldViolation]]:
    """`violations` by the item they belong to, and those of the batch as a whole."""
    by_item: defaultdict[int, list[FieldViolation]] = defaultdict(list)
    whole: list[FieldViolation] = []
    for violation in violations:
        match = _ITEM_PATH.match(violation.field)
        if match is None:
            whole.append(violation)
        else:
            by_item[int(match.group(1))].append(violation)
    return {index: InvalidRequest(found) for index, found in by_item.items()}, whole


def _oversized_batch(message: Message) -> list[FieldViolation]:
    """The batch size rules a batch request breaks: the contract's counts of items and
    of item_contexts (worded as protovalidate words them; each ItemContext has rules
    of its own too, and a million empty ones fit in 2 MB) and the total characters."""
    items: Sequence[Any] = getattr(message, "items")  # noqa: B009 - any batch message type
    contexts: Sequence[Any] = getattr(message, "item_contexts")  # noqa: B009 - as items
    too_many = [
        FieldViolation(
            field=name,
            rule="repeated.max_items",
            message=f"must contain no more than {MAX_BATCH_ITEMS} item(s)",
        )
        for name, repeated in (("items", items), ("item_contexts", contexts))
        if len(repeated) > MAX_BATCH_ITEMS
    ]
    if too_many:
        return too_many
    total_chars = sum(len(item.text) for item in items)
    if total_chars > MAX_BATCH_TOTAL_CHARS:
        return [
            FieldViolation(
                field="items",
                rule="items.total_chars",
                message=f"the items hold {total_chars} characters of text in all; "
                f"at most {MAX_BATCH_TOTAL_CHARS} are allowed",
            )
        ]
    return []
