"""Data-set prompts for `workload.dataset`: ShareGPT-format JSON, plain text and sonnet-style
line files tokenized with a local tokenizer, and vLLM's `random` set (sim/workload.py turns
them into requests with the workload's arrivals).

Tokenizer: a `tokenizer.json` (or a folder holding one) through the `tokenizers` package, or a
transformers folder (AutoTokenizer, local files only). Every text of a file is tokenized once:
the token ids are cached beside the file in `<file>.kvtwin-tokens-<digest>.npz`, the digest
covering the file's and the tokenizer's bytes, so an edit to either makes a new cache. The
cache is written atomically (a temporary file, then a rename); a folder that cannot be written
only costs the caching (noted). Texts are tokenized as they are: no chat template (vLLM's
`completions` backend sends them so; the chat backend adds the model's template on the server).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from sim.scenario import Dataset

CACHE_VERSION = 1
MAX_DATASET_BYTES = 2 << 30          # a ShareGPT dump is ~650 MB; anything over 2 GiB is refused
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
        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as e:              # noqa: BLE001 - the library raises its own exception types
            raise DatasetError(f"{file}: not a tokenizer.json the `tokenizers` package can read ({e})") from None
        template = _folder_chat_template(path) if path.is_dir() else None
        return TextTokenizer(lambda texts: [e.ids for e in tok.encode_batch(texts)],
                             lambda ids: tok.decode(ids, skip_special_tokens=False), tok.get_vocab_size(),
                             _digest([file]), template)
    if path.is_dir():
        return _transformers_tokenizer(path)
    raise DatasetError(f"tokenizer: {path} is neither a tokenizer.json nor a folder holding one")


def _transformers_tokenizer(path: Path) -> TextTokenizer:
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
                         _digest(sorted(p for p in path.iterdir() if p.is_file() and "token" in p.name)), template)


def _folder_chat_template(path: Path) -> Optional[Callable[[list[dict]], list[int]]]:
    """A folder's transformers chat template, when it has one and transformers is installed."""
    config = path / "tokenizer_config.json"
    in_config = config.is_file() and "chat_template" in config.read_text(errors="replace")
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
        h.update(f.read_bytes())
    return h.hexdigest()


def tokenized(path: Path, texts: list[str], tokenizer: Path, selection: str = "all") -> tuple[list[list[int]], list[str], int]:
    """The token ids of `texts` (the texts of `path` that `selection` names, in a fixed order), from
    the cache beside the file when it matches, else encoded and cached. Returns (ids, notes,
    vocabulary size). The cache is one .npz: every id as int32 and each text's start offset."""
    encode, tok_digest, vocab = load_tokenizer(tokenizer)
    digest = hashlib.sha256(path.read_bytes() + tok_digest.encode() + selection.encode()).hexdigest()
    cache = path.with_name(f"{path.name}.kvtwin-tokens-{digest[:16]}.npz")
    cached = _read_cache(cache, digest, len(texts))
    if cached is not None:
        return cached, [f"{path}: token ids from the cache {cache.name}"], vocab
    ids = encode(texts) if texts else []
    notes = [f"{path}: {len(texts)} texts tokenized with {tokenizer}"]
    offsets = np.cumsum([0] + [len(t) for t in ids], dtype=np.int64)
    flat = np.fromiter((i for t in ids for i in t), dtype=np.int32, count=int(offsets[-1]))
    try:
        _write_atomically(cache, lambda f: np.savez(f, version=CACHE_VERSION, digest=digest, ids=flat,
                                                    offsets=offsets))
        notes.append(f"token ids cached in {cache.name}")
    except OSError as e:
        notes.append(f"token ids not cached ({cache.parent} is not writable: {e.strerror})")
    return ids, notes, vocab


def _read_cache(cache: Path, digest: str, count: int) -> Optional[list[list[int]]]:
    if not cache.is_file():
        return None
    try:
        with np.load(cache, allow_pickle=False) as data:
            if int(data["version"]) != CACHE_VERSION or str(data["digest"]) != digest:
                return None
            offsets, flat = data["offsets"], data["ids"]
    except (OSError, KeyError, ValueError):
        return None                                   # a damaged cache is rebuilt
    if len(offsets) != count + 1:
        return None
    flat = flat.tolist()
    return [flat[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


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


def _read(path: Path) -> str:
    if not path.is_file():
        raise DatasetError(f"{path}: no such file (workload.dataset.path)")
    if path.stat().st_size > MAX_DATASET_BYTES:
        raise DatasetError(f"{path}: over the {MAX_DATASET_BYTES >> 30} GiB limit for a data set")
    return path.read_text(encoding="utf-8", errors="replace")


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
    try:
        data = json.loads(_read(ds.path))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{ds.path}: not valid JSON ({e.msg} at line {e.lineno})") from None
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
