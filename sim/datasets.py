"""Data-set prompts for `workload.dataset`: ShareGPT-format JSON, plain text and sonnet-style
line files tokenized with a local tokenizer, and vLLM's `random` set (sim/workload.py turns
them into requests with the workload's arrivals).

Tokenizer: a `tokenizer.json` (or a folder holding one) through the `tokenizers` package, or a
transformers folder (AutoTokenizer, local files only). Every text of a file is tokenized once:
the token ids are cached in kvtwin's cache folder (token_cache_dir: KVTWIN_CACHE_DIR, else
$XDG_CACHE_HOME/kvtwin, else ~/.cache/kvtwin) as `tokens/<digest>.npz`, the digest covering the
file's and the tokenizer's bytes, so an edit to either makes a new cache. Not beside the data
set: a path a scenario names decides what is read, never where anything is written. The cache
is written atomically (a temporary file, then a rename); a folder that cannot be written only
costs the caching (noted). Texts are tokenized as they are: no chat template (vLLM's
`completions` backend sends them so; the chat backend adds the model's template on the server).
"""
from __future__ import annotations

import hashlib
import os
import stat
import zipfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from sim.core.files import FileFormatError, excerpt, load_json, read_bytes, read_text
from sim.scenario import Dataset

CACHE_VERSION = 1
MAX_DATASET_BYTES = 2 << 30          # a ShareGPT dump is ~650 MB; anything over 2 GiB is refused
MAX_DATASET_VALUES = 200_000_000     # JSON values in a data set (ShareGPT: ~2M)
MAX_TOKENIZER_BYTES = 256 << 20      # a tokenizer.json is 2-35 MB; so is any file of a tokenizer folder
# the files of a transformers folder its tokenizer reads (weights and the rest are never opened)
TOKENIZER_FILE_PARTS = ("token", "vocab", "merges", "chat_template", "config.json", ".model", ".tiktoken")
SHAREGPT_FILTER = (4, 1024, 2048)    # vLLM: drop prompt or output < 4, prompt > 1024, prompt + output > 2048
SONNET_BASE_PROMPT = "Pick as many lines as you can from these poem lines:\n"


class DatasetError(ValueError):
    """A data set or tokenizer that cannot be used; the message names the file."""


@dataclass
class Turn:
    prompt: list[int]                 # the user's message (turn 1: with any system text before it)
    answer_len: Optional[int]         # tokens of the recorded answer; None when the file has none


@dataclass
class Prompts:
    conversations: list[list[Turn]]
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- tokenizers

@dataclass
class TextTokenizer:
    """A local tokenizer: encode texts, decode ids, and (transformers folders) a chat template."""

    encode_batch: Callable[[list[str]], list[list[int]]]
    decode: Callable[[list[int]], str]
    vocab_size: int
    digest: str                       # of the tokenizer's files, for caches
    apply_chat_template: Optional[Callable[[list[dict]], list[int]]] = None

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]


def text_tokenizer(path: Path) -> TextTokenizer:
    """A tokenizer.json (or a folder holding one) via `tokenizers`, else a transformers folder."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if file.is_file() and file.suffix == ".json":
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DatasetError("tokenizer: the `tokenizers` package is missing (pip install 'kvtwin[text]')") from None
        text = _read(file, "tokenizer.json", MAX_TOKENIZER_BYTES)      # bounded, UTF-8, named errors
        try:
            tok = Tokenizer.from_str(text)
        except Exception as e:              # noqa: BLE001 - the library raises its own exception types
            raise DatasetError(f"{file}: not a tokenizer.json the `tokenizers` package can read "
                               f"({excerpt(str(e), 120)})") from None
        template = _folder_chat_template(path) if path.is_dir() else None
        return TextTokenizer(lambda texts: [e.ids for e in tok.encode_batch(texts)],
                             lambda ids: tok.decode(ids, skip_special_tokens=False), tok.get_vocab_size(),
                             _digest([file]), template)
    if path.is_dir():
        return _transformers_tokenizer(path)
    raise DatasetError(f"tokenizer: {path} is neither a tokenizer.json nor a folder holding one")


def tokenizer_files(folder: Path) -> list[Path]:
    """The files of a transformers folder its tokenizer may read, each checked: a regular file of
    at most MAX_TOKENIZER_BYTES (the library would read a 50 GB `tokenizer.json`, or a link to
    /dev/zero, to the end)."""
    files = []
    for entry in sorted(folder.iterdir()):
        if not any(part in entry.name for part in TOKENIZER_FILE_PARTS):
            continue
        try:
            info = entry.stat()
        except OSError as e:
            raise DatasetError(f"{entry}: cannot read ({e.strerror or e}) (a file of the tokenizer folder)") from None
        if not stat.S_ISREG(info.st_mode):
            raise DatasetError(f"{entry}: not a regular file (a file of the tokenizer folder {folder})")
        if info.st_size > MAX_TOKENIZER_BYTES:
            raise DatasetError(f"{entry}: {info.st_size / 2**20:.1f} MiB, larger than the "
                               f"{MAX_TOKENIZER_BYTES >> 20} MiB allowed for a file of a tokenizer folder")
        files.append(entry)
    return files


def _transformers_tokenizer(path: Path) -> TextTokenizer:
    files = tokenizer_files(path)                      # checked before the library opens any of them
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DatasetError(f"{path}: a transformers tokenizer folder needs the `transformers` package") from None
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    template = None
    if getattr(tok, "chat_template", None):
        def template(messages: list[dict]) -> list[int]:
            # rendered, then tokenized without special tokens (the template writes its own), as vLLM does
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(tok(text, add_special_tokens=False)["input_ids"])
    return TextTokenizer(lambda texts: [list(ids) for ids in tok(texts)["input_ids"]],
                         lambda ids: tok.decode(ids), len(tok),
                         _digest([p for p in files if "token" in p.name]), template)


def _folder_chat_template(path: Path) -> Optional[Callable[[list[dict]], list[int]]]:
    """A folder's transformers chat template, when it has one and transformers is installed."""
    config = path / "tokenizer_config.json"
    in_config = config.is_file() and "chat_template" in _read(config, "tokenizer_config.json", MAX_TOKENIZER_BYTES)
    # newer transformers keep it in a file of its own
    if not (in_config or (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file()):
        return None
    try:
        return _transformers_tokenizer(path).apply_chat_template
    except (DatasetError, OSError, ValueError):
        return None


def load_tokenizer(path: Path) -> tuple[Callable[[list[str]], list[list[int]]], str, int]:
    """(encode a batch of texts, digest of the tokenizer's files, vocabulary size)."""
    tok = text_tokenizer(path)
    return tok.encode_batch, tok.digest, tok.vocab_size


def _digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(_read_bytes(f, "tokenizer file", MAX_TOKENIZER_BYTES))
    return h.hexdigest()


def tokenized(path: Path, texts: list[str], tokenizer: Path, selection: str = "all") -> tuple[list[list[int]], list[str], int]:
    """The token ids of `texts` (the texts of `path` that `selection` names, in a fixed order), from
    the token cache when it matches, else encoded and cached. Returns (ids, notes, vocabulary
    size). The cache is one .npz: every id as int32 and each text's start offset."""
    encode, tok_digest, vocab = load_tokenizer(tokenizer)
    digest = hashlib.sha256(_read_bytes(path, "data set (workload.dataset.path)", MAX_DATASET_BYTES)
                            + tok_digest.encode() + selection.encode()).hexdigest()
    cache = token_cache_dir() / "tokens" / f"{digest[:32]}.npz"
    cached = _read_cache(cache, digest, len(texts), max_cache_ids(texts))
    if cached is not None:
        return cached, [f"{path}: token ids from the cache {cache}"], vocab
    ids = encode(texts) if texts else []
    notes = [f"{path}: {len(texts)} texts tokenized with {tokenizer}"]
    offsets = np.cumsum([0] + [len(t) for t in ids], dtype=np.int64)
    flat = np.fromiter((i for t in ids for i in t), dtype=np.int32, count=int(offsets[-1]))
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(cache, lambda f: np.savez(f, version=CACHE_VERSION, digest=digest, ids=flat,
                                                    offsets=offsets))
        notes.append(f"token ids cached in {cache}")
    except OSError as e:
        notes.append(f"token ids not cached ({cache.parent} is not writable: {e.strerror})")
    return ids, notes, vocab


def token_cache_dir() -> Path:
    """kvtwin's cache folder: KVTWIN_CACHE_DIR, else $XDG_CACHE_HOME/kvtwin, else ~/.cache/kvtwin
    (the XDG base-directory convention). Chosen by the user's environment, never by a scenario."""
    if os.environ.get("KVTWIN_CACHE_DIR"):
        return Path(os.environ["KVTWIN_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "kvtwin"   # (XDG: absolute only)


def max_cache_ids(texts: list[str]) -> int:
    """More token ids than `texts` can encode to: at most one per UTF-8 byte (<= 4 per character),
    plus a few special tokens per text."""
    return 4 * sum(len(t) for t in texts) + 8 * len(texts) + 64


def _read_cache(cache: Path, digest: str, count: int, max_ids: int) -> Optional[list[list[int]]]:
    if not cache.is_file():
        return None
    _check_cache_bounds(cache, count, max_ids)
    try:
        with np.load(cache, allow_pickle=False) as data:
            if int(data["version"]) != CACHE_VERSION or str(data["digest"]) != digest:
                return None
            offsets, flat = data["offsets"], data["ids"]
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None                                   # a damaged cache is rebuilt
    if flat.dtype != np.int32 or offsets.dtype != np.int64 or flat.ndim != 1 or offsets.ndim != 1:
        return None
    if len(offsets) != count + 1 or offsets[0] != 0 or offsets[-1] != len(flat) or np.any(np.diff(offsets) < 0):
        return None
    flat = flat.tolist()
    return [flat[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


_SMALL_MEMBER = 4096      # the version and digest entries (a scalar, a 64-character string)


def _check_cache_bounds(cache: Path, count: int, max_ids: int) -> None:
    """A cache (a zip of .npy arrays) no larger than its data set can need, read before np.load
    allocates anything: the file, each member as the archive declares it, and each array as its
    header declares it (np.load allocates the header's shape up front). DatasetError naming the
    file otherwise: it is not one kvtwin wrote for this data set."""
    limits = {"version.npy": _SMALL_MEMBER, "digest.npy": _SMALL_MEMBER,
              "ids.npy": 4 * max_ids + _SMALL_MEMBER, "offsets.npy": 8 * (count + 1) + _SMALL_MEMBER}
    def refuse(why: str) -> DatasetError:
        return DatasetError(f"{cache}: {why}; not a token cache kvtwin wrote for {count} texts "
                            f"(delete it: the next run rebuilds it)")

    size = cache.stat().st_size
    if size > sum(limits.values()) + 65536:
        raise refuse(f"{size / 2**20:.1f} MiB, more than the cache of this data set can be")
    try:
        with zipfile.ZipFile(cache) as archive:
            members = [(info, _npy_header(archive, info)) for info in archive.infolist()
                       if info.filename in limits and info.file_size <= limits[info.filename]]
            unexpected = [info for info in archive.infolist()
                          if info.filename not in limits or info.file_size > limits[info.filename]]
    except (zipfile.BadZipFile, ValueError, OSError, EOFError):
        return                                         # damaged: _read_cache rebuilds it
    for info in unexpected:
        if info.filename not in limits:
            raise refuse(f"holds an unexpected entry {excerpt(info.filename)}")
        raise refuse(f"its {info.filename} unpacks to {info.file_size} bytes (at most {limits[info.filename]})")
    for info, (shape, dtype) in members:
        limit = limits[info.filename]
        if dtype.hasobject or float(np.prod(shape, dtype=np.float64)) * dtype.itemsize > limit:
            raise refuse(f"its {info.filename} declares a {shape} {dtype} array (at most {limit} bytes)")


def _npy_header(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[tuple, np.dtype]:
    """(shape, dtype) an .npy member's header declares, read without reading its data."""
    from numpy.lib import format as npy

    with archive.open(info) as member:
        version = npy.read_magic(member)
        read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
        shape, _, dtype = read_header(member)
    return shape, dtype


def _write_atomically(path: Path, write: Callable[[Any], None]) -> None:
    """`write(file)` into a temporary file beside `path`, then renamed over it (the simulation
    layer does not reach sim/output/io.py, whose writer does the same)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_bytes(path: Path, what: str, max_bytes: int) -> bytes:
    try:
        return read_bytes(path, what, max_bytes)
    except FileFormatError as e:
        raise DatasetError(str(e)) from None


def _read(path: Path, what: str = "data set (workload.dataset.path)", max_bytes: int = MAX_DATASET_BYTES) -> str:
    try:
        return read_text(path, what, max_bytes)
    except FileFormatError as e:
        raise DatasetError(str(e)) from None


# ----------------------------------------------------------------------------- formats

def load_prompts(ds: Dataset) -> tuple[Prompts, int]:
    """The data set's conversations as token ids, and the tokenizer's vocabulary size."""
    if ds.format == "sharegpt":
        return _sharegpt(ds)
    if ds.format == "text":
        lines = [line.strip() for line in _read(ds.path).splitlines() if line.strip()]
        if not lines:
            raise DatasetError(f"{ds.path}: no prompt (expected one prompt per line)")
        ids, notes, vocab = tokenized(ds.path, lines, ds.tokenizer)
        return Prompts([[Turn(p, None)] for p in ids], notes), vocab
    raise ValueError(f"load_prompts: {ds.format} has no file of prompts")


def _sharegpt(ds: Dataset) -> tuple[Prompts, int]:
    try:        # a ShareGPT dump holds millions of values: bounded by its size, not by the config bound
        data = load_json(_read(ds.path), ds.path, max_items=MAX_DATASET_VALUES)
    except FileFormatError as e:
        raise DatasetError(str(e)) from None
    if not isinstance(data, list):
        raise DatasetError(f"{ds.path}: expected a JSON list of {{'conversations': [...]}} objects (ShareGPT format)")
    convs = []
    for i, item in enumerate(data):
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or not all(isinstance(t, dict) and isinstance(t.get("value"), str)
                                                  for t in turns):
            raise DatasetError(f"{ds.path}: entry {i}: expected 'conversations', a list of {{'from', 'value'}}")
        convs.append(turns)
    # first turns: only the two messages vLLM reads are tokenized (a ShareGPT dump holds ~100M tokens)
    usable = [turns[:2] for turns in convs if len(turns) >= 2] if ds.turns == "first" else convs
    texts = [t["value"] for turns in usable for t in turns]
    ids, notes, vocab = tokenized(ds.path, texts, ds.tokenizer, selection=ds.turns)
    it = iter(ids)
    tokens = [[(t.get("from"), next(it)) for t in turns] for turns in usable]
    build = _first_turns if ds.turns == "first" else _all_turns
    out, dropped = build(tokens, ds.filter)
    dropped += len(convs) - len(usable)
    notes.append(f"{ds.path}: {len(out)} of {len(convs)} conversations usable ({ds.turns} turns)"
                 + (f"; {dropped} dropped ({'vLLM length filter, ' if ds.filter else ''}fewer than two messages)"
                    if dropped else ""))
    if not out:
        raise DatasetError(f"{ds.path}: no usable conversation ({notes[-1]})")
    return Prompts(out, notes), vocab


def _kept(prompt_len: int, answer_len: int, filter_: bool) -> bool:
    lo, max_prompt, max_total = SHAREGPT_FILTER
    return not filter_ or not (prompt_len < lo or answer_len < lo or prompt_len > max_prompt
                               or prompt_len + answer_len > max_total)


def _first_turns(convs: list[list[tuple[Any, list[int]]]], filter_: bool) -> tuple[list[list[Turn]], int]:
    """vLLM's sharegpt: the first two messages as prompt and completion, whatever their roles."""
    out = [[Turn(turns[0][1], len(turns[1][1]))] for turns in convs
           if len(turns) >= 2 and _kept(len(turns[0][1]), len(turns[1][1]), filter_)]
    return out, len(convs) - len(out)


def _all_turns(convs: list[list[tuple[Any, list[int]]]], filter_: bool) -> tuple[list[list[Turn]], int]:
    """Every answered human message is a request; system text opens the first one; the answer's
    length is its output length. The filter judges a conversation by its first exchange."""
    out = []
    for turns in convs:
        conv: list[Turn] = []
        pending: list[int] = []
        for role, ids in turns:
            if role in ("human", "user"):
                conv.append(Turn(pending + ids, None))
                pending = []
            elif role == "system" and not conv:
                pending = pending + ids
            elif role != "system" and conv and conv[-1].answer_len is None:     # gpt, assistant, ...
                conv[-1].answer_len = len(ids)
        while conv and conv[-1].answer_len is None:        # a last message nobody answered
            conv.pop()
        if conv and all(t.answer_len is not None for t in conv) and \
                _kept(len(conv[0].prompt), conv[0].answer_len, filter_):
            out.append(conv)
    return out, len(convs) - len(out)


def sonnet_lines(ds: Dataset) -> tuple[list[int], list[list[int]], list[str], int]:
    """(base prompt ids, each line's ids, notes, vocabulary size) for vLLM's sonnet set."""
    lines = [line for line in _read(ds.path).splitlines() if line.strip()]
    if not lines:
        raise DatasetError(f"{ds.path}: no line to draw from")
    ids, notes, vocab = tokenized(ds.path, [SONNET_BASE_PROMPT] + [line + "\n" for line in lines], ds.tokenizer)
    return ids[0], ids[1:], notes, vocab
