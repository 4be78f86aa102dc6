"""Reading untrusted text files: bounded, named in every error, strict YAML and JSON.

Every input file kvtwin reads (scenario, profile, HF config, trace, length file) goes through
`read_text`, so a binary, compressed, UTF-16 or oversized file is a one-line error naming the
file instead of a codec traceback. `load_yaml` is `yaml.safe_load` plus three refusals:
duplicate keys (with both line numbers), a document whose alias-expanded size or nesting depth
is beyond a bound (an "alias bomb" expands a few hundred bytes into billions of nodes when
later code walks it), a recursive alias (`a: &a [*a]`, a value that contains itself, which
no walk of it ever finishes), and deep nesting that would overflow the parser's recursion.
`excerpt` is the only way an error message may quote file content.
"""
from __future__ import annotations

import gzip
import io
import json
import reprlib
import stat
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, TextIO

import yaml

MAX_TEXT_BYTES = 64 * 1024 * 1024       # a scenario, profile or config; traces pass their own bound
MAX_YAML_NODES = 1_000_000               # after alias expansion
MAX_DEPTH = 64
MAX_INT = 2**63 - 1                      # what numpy's int64 (and so every length column) holds
MAX_STREAM_BYTES = 4 << 30              # a streamed file (a trace), decompressed size for a gzip one
EXCERPT_CHARS = 40
FILE_EXCERPT_CHARS = 20                  # a value quoted from a data file (a trace, a length file)


class FileFormatError(ValueError):
    """A file that cannot be read as the text it should be; the message starts with the path."""


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """A bounded, escaped quote of untrusted data: repr (so control characters show as escapes
    and markup stays text), cut to about `limit` characters with '...' when longer."""
    if isinstance(value, str):
        return repr(value[:limit]) + ("..." if len(value) > limit else "")
    short = _REPR.repr(value)       # reprlib: bounded work even for a huge list
    return short if len(short) <= limit else short[:limit] + "..."


def printable(text: str, limit: int | None = None) -> str:
    """`text` with every character that is not printable (newlines, escapes such as '\\x1b[31m',
    bells, YAML's other line breaks \\x85, \\u2028, \\u2029) written as a backslash escape, so
    untrusted text can go on one terminal line or into a comment of a written file without
    ending the line or driving the terminal; cut to `limit` characters with '...' when longer."""
    short = text if limit is None or len(text) <= limit else text[:limit]
    safe = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in short)
    return safe + ("..." if short is not text else "")


_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict, _REPR.maxlevel = 60, 60, 8, 8, 3
_REPR.maxlong = 40


def file_problem(path: str | Path) -> str | None:
    """Why `path` cannot be read as a file ("no such file", "is a folder", "not a regular file
    ..."), or None. A device or pipe (/dev/zero, a FIFO) reports no size and never ends, and
    opening a FIFO blocks until something writes to it, so only regular files (or links to one)
    are read."""
    try:
        mode = Path(path).stat().st_mode
    except FileNotFoundError:
        return "no such file"
    except OSError as e:
        return f"cannot read ({e.strerror or e})"
    if stat.S_ISDIR(mode):
        return "is a folder"
    if not stat.S_ISREG(mode):
        return "not a regular file (a device, pipe or socket)"
    return None


def require_regular_file(path: str | Path, what: str = "file") -> None:
    """FileFormatError naming `path` unless it is a regular file (see `file_problem`)."""
    problem = file_problem(path)
    if problem:
        raise FileFormatError(f"{path}: {problem}, expected a {what}")


def read_text(path: str | Path, what: str = "file", max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The file as UTF-8 text, or FileFormatError naming it and saying what it looks like instead."""
    return decode(read_bytes(path, what, max_bytes), path, what)


def read_bytes(path: str | Path, what: str = "file", max_bytes: int = MAX_TEXT_BYTES) -> bytes:
    """The file's bytes, at most `max_bytes`, or FileFormatError naming it. Only a regular file
    (a link to one too): a device or pipe (/dev/zero, a FIFO) reports no size and never ends."""
    path = Path(path)
    require_regular_file(path, what)
    try:
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)          # bounded even if the file grows meanwhile
    except FileNotFoundError:
        raise FileFormatError(f"{path}: no such file (expected a {what})") from None
    except PermissionError:
        raise FileFormatError(f"{path}: permission denied (reading a {what})") from None
    except OSError as e:
        raise FileFormatError(f"{path}: cannot read ({e.strerror or e}) (a {what})") from None
    if len(data) > max_bytes:
        size = max(len(data), path.stat().st_size)
        raise FileFormatError(f"{path}: {size / 2**20:.1f} MiB, larger than the {_size(max_bytes)} "
                              f"allowed for a {what}")
    return data


def decode(data: bytes, path: str | Path, what: str = "file") -> str:
    kind = _binary_kind(data)
    if kind:
        raise FileFormatError(f"{path}: {kind}, expected a UTF-8 text {what}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise FileFormatError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}), "
                              f"expected a UTF-8 text {what}") from None
    return text.removeprefix("\ufeff")


def _binary_kind(data: bytes) -> str | None:
    head = data[:4]
    if head.startswith(b"\x1f\x8b"):
        return "a gzip-compressed file (decompress it first)"
    if head.startswith((b"PK\x03\x04", b"\x28\xb5\x2f\xfd", b"BZh", b"\xfd7zX")):
        return "a compressed archive (unpack it first)"
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "UTF-16 text (save it as UTF-8)"
    if b"\x00" in data[:8192]:
        return "a binary file (it holds NUL bytes)"
    return None


class _BoundedStream(io.RawIOBase):
    """A (decompressing) stream that stops with FileFormatError past `limit` bytes: a gzip bomb
    expands a few kilobytes into terabytes, so the compressed size says nothing."""

    def __init__(self, raw: Any, path: Path, what: str, limit: int):
        super().__init__()
        self._raw, self._path, self._what, self._limit, self._count = raw, path, what, limit, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self._raw.readinto(buffer) or 0
        self._count += n
        if self._count > self._limit:
            raise FileFormatError(f"{self._path}: decompresses to more than {_size(self._limit)}, the limit "
                                  f"for a {self._what}; refused (decompress and cut it yourself if it is real)")
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def _size(n: int) -> str:
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB"


def check_csv_header(path: str | Path, header: list[str], read: list[str],
                     error: type[ValueError] = FileFormatError) -> None:
    """`error` naming `path` when a column it reads (`read`) is named twice in `header`:
    csv.DictReader would take the last, an index lookup the first, and neither says so."""
    for name in read:
        where = [i + 1 for i, h in enumerate(header) if h == name]
        if len(where) > 1:
            raise error(f"{path}:1: column {excerpt(name, FILE_EXCERPT_CHARS)} appears "
                        f"{len(where)} times (columns {', '.join(map(str, where))}); expected one column of each name")


def check_csv_row(path: str | Path, line: int, row: list[str], header: list[str],
                  error: type[ValueError] = FileFormatError) -> None:
    """`error` naming `path:line` when the row has fewer or more fields than the header: an
    unquoted comma shifts every column after it."""
    if len(row) != len(header):
        raise error(f"{path}:{line}: {len(row)} fields, expected {len(header)} (the header's columns)")


@contextmanager
def open_text(path: str | Path, what: str = "file", gzip_ok: bool = False,
              max_bytes: int | None = None) -> Iterator[TextIO]:
    """A UTF-8 text file opened for streaming (a trace too big to hold twice): binary, compressed
    and UTF-16 files are refused up front, and a bad byte later on is an error naming the file.
    With `gzip_ok`, a gzip file (by its magic bytes) is decompressed on the fly. The file (a gzip
    one: its decompressed text) may hold at most `max_bytes` (default MAX_STREAM_BYTES)."""
    path = Path(path)
    max_bytes = MAX_STREAM_BYTES if max_bytes is None else max_bytes
    require_regular_file(path, what)
    try:
        size = path.stat().st_size
        with path.open("rb") as raw:
            head = raw.read(8192)
        gzipped = gzip_ok and head.startswith(b"\x1f\x8b")
        if gzipped:
            with gzip.open(path, "rb") as raw:
                head = raw.read(8192)
        kind = _binary_kind(head)
        if kind:
            raise FileFormatError(f"{path}: {kind}, expected a UTF-8 text {what}"
                                  + (" (inside the gzip)" if gzipped else ""))
        if not gzipped and size > max_bytes:
            raise FileFormatError(f"{path}: {size / 2**20:.1f} MiB, larger than the {_size(max_bytes)} allowed "
                                  f"for a {what}")
        binary = (io.BufferedReader(_BoundedStream(gzip.open(path, "rb"), path, what, max_bytes))
                  if gzipped else path.open("rb"))
        f = io.TextIOWrapper(binary, encoding="utf-8-sig", newline="")
    except FileNotFoundError:
        raise FileFormatError(f"{path}: no such file (expected a {what})") from None
    except (OSError, EOFError, zlib.error) as e:      # gzip.BadGzipFile is an OSError
        raise FileFormatError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e}) (a {what})") from None
    try:
        with f:
            yield f
    except UnicodeDecodeError as e:
        raise FileFormatError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a chunk), "
                              f"expected a UTF-8 text {what}") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:     # a truncated or corrupt gzip stream
        raise FileFormatError(f"{path}: a damaged gzip stream ({e}) (a {what})") from None


# ----------------------------------------------------------------------------- YAML

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys and integers too long for any field."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        # Python refuses int() of over 4,300 digits with advice about sys.set_int_max_str_digits;
        # no field takes more than 64 bits, so a long one is refused here, at its line
        digits = sum(c.isdigit() for c in node.value)
        if digits > MAX_INT_DIGITS:      # not "invalid YAML": --set would then take it as text
            raise FileFormatError(f"{self.source}:{node.start_mark.line + 1}: an integer of {digits:,} digits, "
                                  f"longer than any field takes ({MAX_INT_DIGITS} at most)")
        return super().construct_yaml_int(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue          # `<<: *base` entries may be overridden by explicit keys
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:      # an unhashable key; SafeLoader reports it
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {excerpt(key)} (first at line {first}); "
                    f"a key may appear once per mapping", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)
MAX_INT_DIGITS = 100


def load_yaml(text: str, source: str | Path = "<text>") -> Any:
    """yaml.safe_load with duplicate keys, alias bombs, recursive aliases and deep nesting refused
    (FileFormatError)."""
    try:
        loader = _StrictLoader(text)       # (PyYAML's reader refuses control characters here, not in the parse)
    except yaml.reader.ReaderError as e:
        line = text.count("\n", 0, e.position) + 1
        shown = repr(chr(e.character)) if isinstance(e.character, int) else repr(e.character)
        raise FileFormatError(f"{source}:{line}: the character {shown} is not allowed in YAML "
                              f"(a control character; write it escaped in a double-quoted string)") from None
    loader.source = source
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise FileFormatError(f"{source}: nested too deeply (at most {MAX_DEPTH} levels)") from None
        if node is None:
            return None
        _check_expanded_size(node, source)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise FileFormatError(f"{source}: {describe_yaml_error(e)}") from None
    finally:
        loader.dispose()


def describe_yaml_error(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    return f"{where}not valid YAML ({getattr(e, 'problem', None) or e})"


def _check_expanded_size(root: yaml.Node, source: str | Path) -> None:
    """Count the nodes the document would have with every alias expanded, without expanding it,
    and refuse an alias to a node that contains it (`a: &a [*a]`): SafeLoader builds that as a
    self-containing list, and any later walk of it never ends."""
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    open_nodes: set[int] = set()      # entered, not yet sized: the path from the root down to here
    # iterative post-order walk: shared aliases make the graph a DAG, so each node is sized once
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = _children(node)
        if done:
            open_nodes.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children)
            depths[key] = 1 + max((depths[id(c)] for c in children), default=0)
            if sizes[key] > MAX_YAML_NODES:
                raise FileFormatError(f"{source}:{node.start_mark.line + 1}: expands to more than "
                                      f"{MAX_YAML_NODES:,} values (through aliases); refused")
            if depths[key] > MAX_DEPTH:
                raise FileFormatError(f"{source}:{node.start_mark.line + 1}: nested more than {MAX_DEPTH} levels deep")
            continue
        if key in sizes:
            continue
        if key in open_nodes:         # reached again below itself: only an alias can do that
            raise FileFormatError(f"{source}:{node.start_mark.line + 1}: a recursive alias (an anchor used "
                                  f"inside its own value, so the value would contain itself); refused")
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def read_yaml(path: str | Path, what: str = "YAML file", max_bytes: int = MAX_TEXT_BYTES) -> Any:
    return load_yaml(read_text(path, what, max_bytes), path)


def load_package_yaml(text: str) -> Any:
    """YAML that ships inside the package (the catalog, the trained family): written by this project,
    so libyaml's safe loader reads it (the same documents as yaml.safe_load, ~5x less CPU at every
    start-up) without the refusals untrusted files get."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


# ----------------------------------------------------------------------------- JSON

class JsonSyntaxError(FileFormatError):
    """Text that is not JSON at all; keeps json's line, column and reason (a JSON Lines reader
    retries line by line)."""

    def __init__(self, message: str, error: json.JSONDecodeError):
        super().__init__(message)
        self.msg, self.lineno, self.colno = error.msg, error.lineno, error.colno


def load_json(text: str, source: str | Path = "<text>", allow_nan: bool = False,
              max_items: int = MAX_YAML_NODES) -> Any:
    """json.loads with errors that name the source and line, integers bounded to int64,
    nesting bounded (CPython's parser recurses) and duplicate keys refused (json.loads keeps the
    last one silently: `"completed": 20, "completed": 5` would read as 5). NaN/Infinity only
    with `allow_nan` (files another program wrote with Python's json, which writes them)."""
    try:
        value = json.loads(text, parse_int=_bounded_int, parse_constant=None if allow_nan else _no_constant,
                           object_pairs_hook=unique_keys)
    except json.JSONDecodeError as e:
        raise JsonSyntaxError(f"{source}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})", e) from None
    except RecursionError:
        raise FileFormatError(f"{source}: nested too deeply (at most {MAX_DEPTH} levels)") from None
    except _JsonValueError as e:
        raise FileFormatError(f"{source}: {e}") from None
    check_bounded(value, source, max_items=max_items)
    return value


class _JsonValueError(ValueError):
    pass


def _bounded_int(text: str) -> int:
    if len(text) > 19 or abs(int(text)) > MAX_INT:
        raise _JsonValueError(f"integer {excerpt(text, 24)} is beyond the 64-bit range")
    return int(text)


class DuplicateKeyError(_JsonValueError):
    pass


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook refusing a key given twice (DuplicateKeyError); also used by the
    JSON Lines trace reader, which parses line by line without load_json's other checks."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise DuplicateKeyError(f"duplicate key {excerpt(duplicate)} in one object; a key may appear once per object")
    return obj


def _no_constant(name: str) -> Any:
    raise _JsonValueError(f"{name} is not a number JSON allows (expected a finite number)")


def check_bounded(value: Any, source: str | Path, max_depth: int = MAX_DEPTH,
                  max_items: int = MAX_YAML_NODES) -> None:
    """FileFormatError when `value` (parsed JSON/YAML) nests deeper than `max_depth` levels or
    holds more than `max_items` values; stops counting there (shared references count each time)."""
    stack = [(value, 1)]
    count = 0
    while stack:
        item, depth = stack.pop()
        count += 1
        if depth > max_depth:
            raise FileFormatError(f"{source}: nested more than {max_depth} levels deep")
        if count > max_items:
            raise FileFormatError(f"{source}: more than {max_items:,} values")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)


def read_json(path: str | Path, what: str = "JSON file", max_bytes: int = MAX_TEXT_BYTES) -> Any:
    return load_json(read_text(path, what, max_bytes), path)

