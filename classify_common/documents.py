"""Config documents (YAML and JSON) read with bounded cost.

Every file the servers read as configuration goes through here: routes.yaml, the
API keys file, the model config, and a bundle's config.json and manifest.json.
Whatever a file holds, reading it costs at most a pass over MAX_DOCUMENT_BYTES:

- A file larger than the size cap is refused before it is parsed; no more than the
  cap (and one byte) is ever read.
- YAML anchors and aliases are refused where they are composed, so nothing is ever
  expanded: a few hundred bytes of nested aliases would otherwise stand for
  millions of values to whatever walks the document afterwards.
- Collections nest at most MAX_DOCUMENT_DEPTH deep, checked before the parser
  descends (JSON is scanned first, since `json.loads` recurses in C).
- A mapping that names the same key twice is refused, where the parsers would
  silently keep the last value.

    DocumentRefused           the message starts with the file (and line when known)
    ├── DocumentTooLarge      over the size cap
    ├── DocumentTooDeep       nested deeper than the depth cap
    ├── YamlAliasRefused      a YAML anchor or alias
    ├── YamlMergeRefused      a YAML merge key (<<)
    ├── DuplicateKey          one key twice in a mapping
    └── MalformedDocument     not UTF-8, or not valid YAML or JSON

Callers translate these into their own errors (`raise RoutesFileError(...) from
exc`); `source` is how the message names the file (a path, or a bundle file's name).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import yaml
from yaml.composer import Composer

# Bytes a config document may hold. The largest real ones (a keys file with a key
# per client) are a few KiB. A YAML file this size parses in at most about 0.4 s on
# one core with libyaml (1.8 s on PyYAML's pure-Python parser); JSON in 0.04 s.
MAX_DOCUMENT_BYTES = 256 * 1024
# Collections (mappings, lists) nested inside one another, the outermost counting 1.
# routes.yaml needs 6 (`routes[0].match.header.values`); JSON bundle files need 3.
MAX_DOCUMENT_DEPTH = 32
# Characters a YAML integer may be written in (sign, prefix and underscores included).
MAX_INTEGER_CHARS = 100


class DocumentRefused(ValueError):
    """A config document cannot be read within its bounds; the message names where."""

    def __init__(
        self, source: str, problem: str, *, line: int | None = None, column: int | None = None
    ) -> None:
        place = source if line is None else f"{source}:{line}"
        if line is not None and column is not None:
            place += f":{column}"
        super().__init__(f"{place}: {problem}")
        self.source = source
        self.problem = problem
        self.line = line  # 1-based, None when the problem has no one place
        self.column = column  # 1-based


class DocumentTooLarge(DocumentRefused):
    """The file holds more bytes than the size cap allows."""


class NotARegularFile(DocumentRefused):
    """The path names a directory, a FIFO, a device or a socket, not a file."""


class DocumentTooDeep(DocumentRefused):
    """Mappings and lists nest deeper than the depth cap allows."""


class YamlAliasRefused(DocumentRefused):
    """A YAML anchor or alias: refused, so that nothing in a document is ever expanded."""


class YamlMergeRefused(DocumentRefused):
    """A YAML merge key (`<<`): it sets keys no line of the mapping names, and a key it
    repeats is a key twice that the duplicate check would not see."""


class DuplicateKey(DocumentRefused):
    """A mapping names the same key twice."""


class MalformedDocument(DocumentRefused):
    """The bytes are not UTF-8, or the text is not valid YAML or JSON."""


def read_document(
    path: Path, *, source: str | None = None, max_bytes: int = MAX_DOCUMENT_BYTES
) -> bytes:
    """The bytes of `path`, refused with DocumentTooLarge past `max_bytes`, and with
    NotARegularFile when it is not a file.

    Reads at most one byte past the cap, so a huge file (or an endless one, such as a
    device) costs no more than a small one. Opened without waiting: a FIFO put in a
    watched file's place held the watcher's thread until a writer came, every later
    edit went unapplied, and the process could not exit (its executor waited for the
    thread). OSError is the caller's to report.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFile(source or str(path), f"{describe_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
        stream = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with stream:
        data = stream.read(max_bytes + 1)
        if len(data) > max_bytes:
            size = os.fstat(stream.fileno()).st_size
            held = f"{size} bytes" if size > max_bytes else f"more than {max_bytes} bytes"
            raise DocumentTooLarge(
                source or str(path),
                f"{held}, over the {max_bytes}-byte limit for a config file",
            )
    return data


def _decode(data: bytes | str, source: str) -> str:
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise MalformedDocument(
            source, f"not UTF-8 text: byte {data[exc.start]:#04x}", line=line
        ) from exc


_MERGE_TAG = "tag:yaml.org,2002:merge"
_INT_TAG = "tag:yaml.org,2002:int"


class _BoundedComposer(Composer):
    """PyYAML's composer, refusing anchors, aliases, duplicate keys and deep nesting as
    it builds the node tree. The parser hands it one event at a time, so a refusal
    reads no further into the file."""

    # Provided by the parser this composer is mixed with (Python's or libyaml's).
    peek_event: Callable[[], yaml.Event]

    def bound(self, source: str, max_depth: int) -> None:
        self._source = source
        self._max_depth = max_depth
        self._depth = 0  # collections open around the node being composed

    def _refuse(self, error: type[DocumentRefused], problem: str, mark: Any) -> NoReturn:
        # `mark` is an event's or node's yaml.Mark (the stubs type it loosely).
        raise error(self._source, problem, line=mark.line + 1, column=mark.column + 1)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self._refuse(
                YamlAliasRefused,
                f"alias *{event.anchor}: YAML anchors and aliases are refused; "
                "write the value out in full",
                event.start_mark,
            )
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self._refuse(
                YamlAliasRefused,
                f"anchor &{anchor}: YAML anchors and aliases are refused; "
                "write the value out in full",
                event.start_mark,
            )
        if not isinstance(event, yaml.SequenceStartEvent | yaml.MappingStartEvent):
            node = super().compose_node(parent, index)
            if node is not None and node.tag == _INT_TAG and len(node.value) > MAX_INTEGER_CHARS:
                # A hex or binary literal escapes Python's 4,300-digit limit as it is
                # read, and then every message that named the value raised ValueError
                # (str() of it) instead of naming the file and line.
                self._refuse(
                    MalformedDocument,
                    f"a whole number written in {len(node.value):,} characters; "
                    f"no setting needs more than {MAX_INTEGER_CHARS}",
                    node.start_mark,
                )
            return node
        if self._depth >= self._max_depth:
            self._refuse(
                DocumentTooDeep,
                f"mappings and lists nest deeper than {self._max_depth} levels",
                event.start_mark,
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_mapping_node(self, anchor: Any) -> yaml.MappingNode:
        node: yaml.MappingNode = super().compose_mapping_node(anchor)
        seen: set[tuple[str, str]] = set()
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode):
                continue
            if key.tag == _MERGE_TAG:
                # `<<: {role: admin}` set a key no line of the mapping names, and
                # `a: 1` beside `<<: {a: 2}` was a key twice that no refusal saw.
                self._refuse(YamlMergeRefused, "merge keys (<<) are not read", key.start_mark)
            identity = (key.tag, key.value)
            if identity in seen:
                self._refuse(DuplicateKey, f"key {key.value!r} appears twice", key.start_mark)
            seen.add(identity)
        return node


class _PythonYamlLoader(_BoundedComposer, yaml.SafeLoader):
    """The bounded composer over PyYAML's pure-Python scanner and parser."""


if yaml.__with_libyaml__:

    class _LibyamlLoader(_BoundedComposer, yaml.CSafeLoader):
        """The bounded composer over libyaml's scanner and parser, about 20x faster
        than the Python ones: the composer (Python, here) comes first in the MRO, so
        libyaml's own composer, which would expand aliases, is never used."""

        def __init__(self, stream: str) -> None:
            yaml.CSafeLoader.__init__(self, stream)
            Composer.__init__(self)


def _yaml_loader(text: str, source: str, max_depth: int) -> _PythonYamlLoader | _LibyamlLoader:
    loader = _LibyamlLoader(text) if yaml.__with_libyaml__ else _PythonYamlLoader(text)
    loader.bound(source, max_depth)
    return loader


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        context = f" ({exc.context})" if exc.context else ""
        return f"not valid YAML: {exc.problem}{context}"
    return f"not valid YAML: {exc}"


def _yaml_line(exc: yaml.YAMLError) -> tuple[int | None, int | None]:
    mark = exc.problem_mark if isinstance(exc, yaml.MarkedYAMLError) else None
    return (None, None) if mark is None else (mark.line + 1, mark.column + 1)


def compose_yaml(
    data: bytes | str, source: str, *, max_depth: int = MAX_DOCUMENT_DEPTH
) -> yaml.Node | None:
    """The node tree of a one-document YAML text (None when empty), each node with its
    line: what error messages use to say where a bad value sits."""
    loader = _yaml_loader(_decode(data, source), source, max_depth)
    try:
        return loader.get_single_node()
    except yaml.YAMLError as exc:
        line, column = _yaml_line(exc)
        raise MalformedDocument(source, _yaml_problem(exc), line=line, column=column) from exc
    finally:
        loader.dispose()


def line_of_path(node: yaml.Node, where: str) -> int | None:
    """The 1-based line of the value at `where` (`routes[2].fallback[0]`) in a composed
    document, or of its nearest enclosing value (for a missing key)."""
    lines = _line_index(node)
    while where:
        if where in lines:
            return lines[where]
        where = where[: max(where.rfind("."), where.rfind("["), 0)]
    return None


def _line_index(node: yaml.Node, path: str = "") -> dict[str, int]:
    """Path of every value in the document to its 1-based line."""
    lines = {path: node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            child = f"{path}.{key_node.value}" if path else str(key_node.value)
            lines.update(_line_index(value_node, child))
            lines[child] = key_node.start_mark.line + 1  # the key's line reads best
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines.update(_line_index(item, f"{path}[{index}]"))
    return lines


def parse_yaml(data: bytes | str, source: str, *, max_depth: int = MAX_DOCUMENT_DEPTH) -> Any:
    """The value of a one-document YAML text (None when empty), within the bounds."""
    loader = _yaml_loader(_decode(data, source), source, max_depth)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        line, column = _yaml_line(exc)
        raise MalformedDocument(source, _yaml_problem(exc), line=line, column=column) from exc
    except DocumentRefused:
        raise
    except (ValueError, ArithmeticError) as exc:
        # An integer too long for int() (over sys.get_int_max_str_digits() digits), or
        # a sexagesimal float (1:2:3.5) past a float's range.
        raise MalformedDocument(source, f"not valid YAML: {exc}") from exc
    finally:
        loader.dispose()


# A JSON string, or a bracket. A string is matched to its closing quote or, if it has
# none, to the end of the text: the pattern cannot fail once it starts, so a stray
# quote never makes the scan start again inside the rest of the text.
_JSON_STRING_OR_BRACKET = re.compile(r'"(?:[^"\\]|\\[\s\S]?)*(?:"|\Z)|[\[\]{}]')


def _check_json_depth(text: str, source: str, max_depth: int) -> None:
    """Refuse nesting past `max_depth` before `json.loads` recurses into it (brackets
    inside strings are text, so strings are stepped over)."""
    depth = 0
    for match in _JSON_STRING_OR_BRACKET.finditer(text):
        char = text[match.start()]
        if char in "[{":
            depth += 1
            if depth > max_depth:
                line = text.count("\n", 0, match.start()) + 1
                column = match.start() - text.rfind("\n", 0, match.start())
                raise DocumentTooDeep(
                    source,
                    f"objects and arrays nest deeper than {max_depth} levels",
                    line=line,
                    column=column,
                )
        elif char in "]}":
            depth -= 1


# A \uD800-\uDFFF escape: half of a pair, which JSON allows alone. Looked for in the
# text first, so that only a document with one is walked.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _refuse_lone_surrogates(value: Any, source: str) -> None:
    """MalformedDocument if a string of `value` (a key or a value) holds half of a
    surrogate pair: no UTF-8 can carry it, and a label made of one loaded, then broke
    every answer that named it (protobuf strings are UTF-8)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise MalformedDocument(
                    source,
                    f"the string {item!r} holds half of a surrogate pair (a lone \\u escape)",
                ) from None


def parse_json(data: bytes | str, source: str, *, max_depth: int = MAX_DOCUMENT_DEPTH) -> Any:
    """The value of a JSON text, within the bounds."""
    text = _decode(data, source)
    _check_json_depth(text, source, max_depth)

    def refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        value = dict(pairs)
        if len(value) == len(pairs):
            return value
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(source, f"key {key!r} appears twice in one object")
            seen.add(key)
        return value  # unreachable: a shorter dict means some key came twice

    try:
        value = json.loads(text, object_pairs_hook=refuse_duplicates)
    except json.JSONDecodeError as exc:
        raise MalformedDocument(
            source, f"not valid JSON: {exc.msg}", line=exc.lineno, column=exc.colno
        ) from exc
    except DocumentRefused:
        raise
    except ValueError as exc:
        # An integer too long for int() (over sys.get_int_max_str_digits() digits).
        raise MalformedDocument(source, f"not valid JSON: {exc}") from exc
    if _SURROGATE_ESCAPE.search(text):
        _refuse_lone_surrogates(value, source)
    return value


def load_yaml(path: Path, *, source: str | None = None, max_bytes: int = MAX_DOCUMENT_BYTES) -> Any:
    """Read and parse a YAML config file within the bounds (see the module docstring)."""
    name = source or str(path)
    return parse_yaml(read_document(path, source=name, max_bytes=max_bytes), name)


def load_json(path: Path, *, source: str | None = None, max_bytes: int = MAX_DOCUMENT_BYTES) -> Any:
    """Read and parse a JSON config file within the bounds (see the module docstring)."""
    name = source or str(path)
    return parse_json(read_document(path, source=name, max_bytes=max_bytes), name)


def describe_kind(mode: int) -> str:
    """What a file that is not a regular one is (its `st_mode`), for a refusal: "a
    directory", "a FIFO"..."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"
