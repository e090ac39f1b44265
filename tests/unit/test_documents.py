"""Config documents are read with bounded cost: each bound refuses with file and line."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from classify_common.documents import (
    MAX_DOCUMENT_BYTES,
    MAX_DOCUMENT_DEPTH,
    DocumentTooDeep,
    DocumentTooLarge,
    DuplicateKey,
    MalformedDocument,
    NotARegularFile,
    YamlAliasRefused,
    YamlMergeRefused,
    compose_yaml,
    load_json,
    load_yaml,
    parse_json,
    parse_yaml,
)

Parse = Callable[[str | bytes, str], Any]

# 9 ** 7 (4.8 million) strings behind 400 bytes: what froze the orchestrator for 8 s
# when its refusal walked the expanded tree to find a line number.
ALIAS_BOMB = "version: 1\na: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]\n"
    for previous, name in zip("abcdef", "bcdefg", strict=True)
)


def test_nested_aliases_are_refused_at_the_first_anchor_without_expanding(
    tmp_path: Path,
) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(ALIAS_BOMB)
    started = time.perf_counter()
    with pytest.raises(YamlAliasRefused) as caught:
        load_yaml(path)
    # Refused at the first anchor in about a millisecond; expanding takes seconds. The
    # bound is loose so that a busy machine does not fail it.
    assert time.perf_counter() - started < 1.0
    assert (caught.value.source, caught.value.line, caught.value.column) == (str(path), 2, 4)
    assert str(caught.value).startswith(f"{path}:2:4: anchor &a: YAML anchors and aliases")


def test_an_alias_alone_is_refused_naming_its_line() -> None:
    with pytest.raises(YamlAliasRefused, match=r"^t\.yaml:2:4: alias \*x: "):
        parse_yaml("a: 1\nb: *x\n", "t.yaml")


def test_a_file_over_the_cap_is_refused_with_its_size_and_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("a: " + "x" * MAX_DOCUMENT_BYTES + "\n")
    size = path.stat().st_size
    with pytest.raises(DocumentTooLarge) as caught:
        load_yaml(path)
    assert str(caught.value) == (
        f"{path}: {size} bytes, over the {MAX_DOCUMENT_BYTES}-byte limit for a config file"
    )


def test_an_endless_device_is_refused_before_any_read() -> None:
    """Not read up to the cap either: only a regular file is read (a FIFO's open waited
    for a writer, holding a watcher's thread)."""
    with pytest.raises(NotARegularFile, match=r"/dev/zero: a device, not a regular file"):
        load_json(Path("/dev/zero"), max_bytes=1024)


@pytest.mark.parametrize(
    ("parse", "text", "where"),
    [
        (parse_yaml, "[" * (MAX_DOCUMENT_DEPTH + 1) + "]" * (MAX_DOCUMENT_DEPTH + 1), "1:33"),
        (parse_json, "[" * (MAX_DOCUMENT_DEPTH + 1) + "]" * (MAX_DOCUMENT_DEPTH + 1), "1:33"),
        # Unclosed and far too deep: refused at the first level past the cap, long before
        # json.loads would recurse into the rest.
        (parse_json, '{"a": ' * 100_000, "1:193"),
    ],
)
def test_nesting_past_the_depth_cap_is_refused_where_it_starts(
    parse: Parse, text: str, where: str
) -> None:
    with pytest.raises(DocumentTooDeep, match=rf"^doc:{where}: .* deeper than 32 levels"):
        parse(text, "doc")


def test_nesting_up_to_the_cap_and_brackets_inside_strings_are_accepted() -> None:
    nested = "[" * MAX_DOCUMENT_DEPTH + "]" * MAX_DOCUMENT_DEPTH
    assert parse_yaml(nested, "doc") == parse_json(nested, "doc")
    assert parse_json('{"a": "[[[[{{{{\\"" }', "doc") == {"a": '[[[[{{{{"'}


def test_a_stray_quote_costs_one_pass_of_the_depth_scan() -> None:
    # Every quote but the first is escaped, so the string never closes: the scan must
    # not restart inside it at each escaped quote (that would be quadratic).
    text = '"' + '\\"' * (MAX_DOCUMENT_BYTES // 2 - 1)
    started = time.perf_counter()
    with pytest.raises(MalformedDocument, match="not valid JSON"):
        parse_json(text, "doc")
    # One pass takes milliseconds; a scan restarting at each quote, hours.
    assert time.perf_counter() - started < 2.0


def test_duplicate_keys_are_refused() -> None:
    with pytest.raises(DuplicateKey, match=r"^doc:3:1: key 'a' appears twice"):
        parse_yaml("a: 1\nb: 2\na: 3\n", "doc")
    with pytest.raises(DuplicateKey, match=r"^doc: key 'a' appears twice in one object"):
        parse_json('{"a": 1, "b": {"a": 2}, "a": 3}', "doc")


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        (parse_yaml, "version: [1\n", r"^doc:2:1: not valid YAML: "),
        (parse_yaml, "a: !!python/object:os.system x\n", r"^doc:1:4: not valid YAML: "),
        (parse_yaml, "a: 1\n---\nb: 2\n", r"^doc:2:1: not valid YAML: "),
        (parse_yaml, "a: " + "1" * 5000, r"^doc:1:4: a whole number written in 5,000 characters"),
        (parse_json, '{"a": [1, 2', r"^doc:1:12: not valid JSON: "),
        (parse_json, "1" * 5000, r"^doc: not valid JSON: .*digits"),
        (parse_json, b"\n\xff", r"^doc:2: not UTF-8 text: byte 0xff"),
    ],
)
def test_malformed_text_is_refused_naming_the_place(
    parse: Parse, text: str | bytes, message: str
) -> None:
    with pytest.raises(MalformedDocument, match=message):
        parse(text, "doc")


def test_values_read_as_the_safe_loader_reads_them() -> None:
    text = "a: {b: [1, {c: 2}], d: null, e: 1.5, f: true}\ng: 3\n"
    assert parse_yaml(text, "doc") == yaml.safe_load(text)
    assert parse_yaml("", "doc") is None


def test_composed_nodes_keep_their_lines() -> None:
    node = compose_yaml("a:\n  b: [1, 2]\n", "doc")
    assert isinstance(node, yaml.MappingNode)
    (_, inner), *_ = node.value
    assert inner.start_mark.line + 1 == 2


def test_half_of_a_surrogate_pair_in_json_is_refused_and_a_whole_pair_read() -> None:
    """JSON allows a lone \\uD800 escape, which no UTF-8 can carry: a label made of one
    loaded and passed `verify --load`, then broke every answer that named it."""
    with pytest.raises(MalformedDocument, match="half of a surrogate pair"):
        parse_json(b'{"labels": ["pos\\ud800"]}', "config.json")
    with pytest.raises(MalformedDocument, match="half of a surrogate pair"):
        parse_json(b'{"\\udfff": 1}', "config.json")
    assert parse_json(b'{"a": "\\ud83d\\ude00", "b": "\\\\ud800"}', "x") == {
        "a": "\U0001f600",
        "b": "\\ud800",
    }


def test_a_merge_key_is_refused_naming_its_line() -> None:
    """`<<: {role: admin}` set a key no line of the mapping named, and `a: 1` beside
    `<<: {a: 2}` was a key twice that the duplicate check never saw."""
    for text in ("role: user\n<<: {role: admin}\n", "a: 1\n<<: {a: 2}\n"):
        with pytest.raises(YamlMergeRefused, match=r"^keys\.yaml:2:1: merge keys"):
            parse_yaml(text, "keys.yaml")


def test_a_number_past_a_floats_range_is_a_malformed_document() -> None:
    # A sexagesimal float: int() has a digit cap, float() raises OverflowError.
    with pytest.raises(MalformedDocument, match="not valid YAML"):
        parse_yaml("rate: 1" + ":1" * 400 + ".5\n", "keys.yaml")


@pytest.mark.parametrize("literal", ["0x" + "f" * 4_000, "0b" + "1" * 200, "1" * 101])
def test_an_integer_written_long_is_refused_naming_its_line(literal: str) -> None:
    """A hex or binary literal escapes Python's 4,300-digit cap as it is read; every
    message that then named the value raised ValueError (str() refuses such an int):
    start-up ended in a traceback and a reload was logged as a bug, no line named."""
    with pytest.raises(MalformedDocument, match=r"^routes\.yaml:2:\d+: a whole number written in"):
        parse_yaml(f"version: 1\nbackends: {{b: {{timeout: {literal}}}}}\n", "routes.yaml")
    # Within the cap, read as the safe loader reads it.
    assert parse_yaml("n: 0x" + "f" * 90 + "\n", "keys.yaml") == {"n": int("f" * 90, 16)}
