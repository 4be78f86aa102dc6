"""Requests and their token content, described as segments so nothing long is materialised.

A prompt is a list of segments. A *keyed* segment is a tuple (key, length): its token ids
are a pure function of the 64-bit key (`segment_tokens`), so equal keys mean equal tokens
and a block's identity can be hashed from (key, start, end) pieces. A *literal* segment is
a list of token ids (requests that arrive as ids, and the live output of the server).
Every request ends with its output segment: keyed and scripted for workload requests (the
engine appends the scripted token, so simulator and engine hash the same blocks), literal
and growing for live requests.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Callable, Optional, Union

import numpy as np

from sim.core.status import FINISHED, WAITING, Status  # noqa: F401  (Status: re-exported)

Segment = Union[tuple, list]  # (key, length) | [token ids]
NO_PRIVATE_BLOCK = 1 << 62    # Request.first_private_block of a request with no private block
# Request._workload_arrival until a client sends it at a time of the run's own (no arrival is
# negative; a plain float, so a pickled request keeps its meaning)
NOT_SENT = -1.0


def stable_key(*parts: object) -> int:
    """A 63-bit key that is the same in every process (Python's str hash is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def stable_keys(*head: object) -> Callable[[int], int]:
    """`i -> stable_key(*head, i)`, the same keys at under half the cost, for keying many ints.

    repr((*head, i)) is repr(head)'s text up to its closing bracket, ", ", i's digits and ")"
    (head holds at least one part), so the hash state after that common start is made once and
    copied for each i. An i that is not exactly an int (a bool, an enum) goes the long way:
    its repr is not its digits."""
    assert head, "stable_keys needs at least one fixed part"
    start = hashlib.blake2b(repr(head)[:-1].rstrip(",").encode() + b", ", digest_size=8)
    copy, from_bytes = start.copy, int.from_bytes

    def key(i: int) -> int:
        if type(i) is not int:
            return stable_key(*head, i)
        h = copy()
        h.update(b"%d)" % i)
        return from_bytes(h.digest(), "little") >> 1
    return key


@lru_cache(maxsize=64, typed=True)
def output_keys(seed: object) -> Callable[[int], int]:
    """`id -> key` of the scripted output segment of the workload request `id` made with `seed`
    (make_request's; a workload making many requests looks it up once)."""
    return stable_keys("output", seed)


@lru_cache(maxsize=1024, typed=True)
def tenant_salt(tenant: str) -> int:
    """The salt that starts the block hash chain of a salted tenant's requests."""
    return stable_key("tenant", tenant)


@lru_cache(maxsize=4096)
def _segment_tokens_cached(key: int, length: int, vocab_size: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(key))
    tokens = rng.integers(0, vocab_size, size=length, dtype=np.int64)
    tokens.setflags(write=False)
    return tokens


def segment_tokens(key: int, length: int, vocab_size: int) -> np.ndarray:
    """Token ids of a keyed segment. A prefix of a longer segment with the same key is identical."""
    # Generate in chunks of 4096 so any length of the same key shares its prefix.
    chunk = 4096
    parts = []
    for c in range(0, length, chunk):
        block = _segment_tokens_cached(stable_key(key, c // chunk), chunk, vocab_size)
        parts.append(block[: min(chunk, length - c)])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def segment_len(seg: Segment) -> int:
    return seg[1] if isinstance(seg, tuple) else len(seg)


class Request:
    """A request's workload description plus the scheduling state the policy keeps on it.

    Its progress (`num_computed`, `num_output`, `last_emit`) is plain fields. While a request
    decodes steadily it may belong to a decode cohort (sim/core/fast/cohort.py), which advances
    all its members by one token per step in O(1): it then turns into a `CohortMember`, whose
    progress fields are properties computed from the cohort's counters and the `cohort_*` fields
    (the cohort's own, read and written by it alone), until it leaves the cohort.
    """

    __slots__ = (
        # workload
        "id", "arrival", "_workload_arrival", "segments", "prompt_len", "output_len", "tenant", "salt", "priority",
        "is_warmup", "next_turn", "think_time", "conversation", "eos_token_id", "replica", "own_prompt_tokens",
        "is_live", "max_len",
        # the LoRA adapter it asks for (vLLM's lora_int_id, >= 1), 0 for the base model
        "lora_id",
        # prefill/decode disaggregation (sim/disagg.py): None, "send" (a prefill engine keeps the KV
        # after the first token until a decode engine read it) or "receive" (the prompt's KV was read)
        "kv_transfer",
        # scheduling state
        "status", "num_output", "num_computed", "blocks", "group_tables", "block_hashes",
        "num_registered", "kv_lease", "window_frees", "num_cached_tokens", "num_preemptions", "reject_reason", "_hash_cursor",
        "_private_start",
        # a decode cohort's (sim/core/fast/cohort.py): its members' progress as offsets from its counters
        "cohort", "cohort_gen", "cohort_computed", "cohort_output", "cohort_pause_index", "cohort_private_fills",
        # step bookkeeping (step indices; drivers turn them into times)
        "admit_step", "run_seq", "first_token_step", "finish_step", "emit_runs", "emit_start", "last_emit",
        "chunk_steps",
    )

    def __init__(self, id: int, arrival: Optional[float], segments: list[Segment], output_len: int,
                 output_segment: Segment, tenant: Optional[str] = None, salt: int = 0,
                 priority: int = 0, is_warmup: bool = False):
        self.id = id
        self.arrival = arrival
        self._workload_arrival = NOT_SENT
        self.segments = segs = list(segments)
        # (segment_len inlined, and a loop: a comprehension here counted ~3k instructions, a
        # quarter of making a Request, for its function object and frame)
        prompt_len = 0
        for s in segs:
            prompt_len += s[1] if isinstance(s, tuple) else len(s)
        self.prompt_len = prompt_len
        segs.append(output_segment)
        self.output_len = output_len
        # prompt + output_len: an attribute, read at intake, admission, routing and retirement
        # (a live request's cut at EOS changes both together: `cut_output`)
        self.max_len = self.prompt_len + output_len
        self.tenant = tenant
        self.salt = salt
        self.priority = priority
        self.is_warmup = is_warmup
        self.next_turn: Optional[Request] = None
        self.think_time = 0.0
        self.conversation: Optional[int] = None
        self.eos_token_id: Optional[int] = None
        self.replica = 0
        # the prompt's last tokens that only this request carries (a unique user message), set
        # by the workload; 0 when unknown (a trace's or a client's prompt may be anyone's)
        self.own_prompt_tokens = 0
        # Output sampled live (the server: a literal output segment that grows), not scripted by
        # the workload. (An attribute, not a property: read at every emission.)
        self.is_live = isinstance(output_segment, list)
        self.lora_id = 0
        self.reset()

    def reset(self) -> None:
        """Clear all scheduling state, so one workload can be replayed by several runs."""
        if type(self) is not Request:      # (a cohort member of a run that stopped short is one no more)
            self.__class__ = Request
        if self._workload_arrival != NOT_SENT:   # the arrival the workload gave, not a run's send time
            self.arrival, self._workload_arrival = self._workload_arrival, NOT_SENT
        self.status = WAITING
        self.kv_transfer: Optional[str] = None
        self.num_output = 0                # output tokens known (emitted, or appended by the engine)
        self.num_computed = 0              # tokens whose KV is computed or scheduled to be (vLLM commits at schedule time)
        self.cohort = None                 # the decode cohort it belongs to, if any
        self.cohort_gen = 0
        self.cohort_computed = self.cohort_output = self.cohort_pause_index = 0
        self.cohort_private_fills = False  # a cohort member whose fills are private blocks
        self.blocks: list[int] = []
        # Hybrid / sliding-window models: one block table per KV cache group (group_tables[0] is
        # `blocks`), kept by sim/core/kv/coordinator.py's HybridCoordinator; None otherwise.
        self.group_tables: Optional[list[list[int]]] = None
        # what its sliding groups freed behind the window while it runs (HybridCoordinator's records)
        self.window_frees: Optional[list[tuple]] = None
        self.block_hashes: list[int] = []
        self.num_registered = 0
        self.kv_lease: Optional[int] = None   # the pool's shared lease on its prefix hit, if any (CountingBlockPool)
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.reject_reason: Optional[str] = None
        self._hash_cursor = (0, 0, None, 0)
        self._private_start: Optional[int] = None    # first_private_block's token, once asked
        self.admit_step = -1
        self.run_seq = -1                  # position in the running list's order (set at each admission)
        self.first_token_step = -1
        self.finish_step = -1
        self.emit_runs: list[int] = []
        self.emit_start = -1
        self.last_emit = -2                # the step that emitted its latest token
        self.chunk_steps: list[int] = []   # steps of prefill chunks that emitted no token

    def sent_at(self, now: float) -> None:
        """The client sent it at `now` (a closed loop's free slot, a follow-up turn's release): its
        arrival from now on, the one its latencies count from; reset() gives back the workload's, so
        a replay of the same requests sends them as the workload did, not as the last run did."""
        if self._workload_arrival == NOT_SENT:
            self._workload_arrival = self.arrival
        self.arrival = now

    @property
    def num_tokens(self) -> int:
        """Tokens known so far: the prompt plus every output token appended."""
        return self.prompt_len + self.num_output

    def append_output(self) -> None:
        """One more output token is known (the scripted one, or the live one just sampled)."""
        assert self.cohort is None
        self.num_output += 1

    def cut_output(self, output_len: int) -> None:
        """A live request sampled EOS: its output ends at `output_len` tokens."""
        self.output_len = output_len
        self.max_len = self.prompt_len + output_len

    def emit(self, step: int) -> bool:
        """Its next token was emitted at `step` (a request scheduled one by one, no cohort member):
        extend its run of consecutive emissions or start one, and count the token. Returns whether
        it was the last. (One call where the scheduler made five property reads and writes.)"""
        assert self.cohort is None
        last = self.last_emit
        if last != step - 1:               # a new run of consecutive emissions
            if self.emit_start >= 0:
                self.emit_runs += (self.emit_start, last)
            self.emit_start = step
            if self.first_token_step < 0:
                self.first_token_step = step
        self.last_emit = step
        self.num_output += 1
        return self.num_output >= self.output_len

    def close_emit_run(self) -> None:
        """Close the run of emissions of a request that ended (it has left any cohort)."""
        assert self.cohort is None
        if self.emit_start >= 0:
            self.emit_runs += (self.emit_start, self.last_emit)
            self.emit_start = -1

    @property
    def is_finished(self) -> bool:
        return self.status >= FINISHED

    def first_private_block(self, block_size: int) -> int:
        """The first block whose content only this request can ever look up, or NO_PRIVATE_BLOCK.

        A block holding any of the request's own content (its scripted output, the tail of its
        prompt the workload marked as its own) is looked up by nobody else unless a later turn
        carries it in its prompt (`next_turn`), and by the request itself only after a preemption.
        A live output is literal tokens a client may send back: never private. The pool keeps such
        blocks out of its hash map while held (sim/core/kv/coordinator.py)."""
        start = self._private_start
        if start is None:       # (asked first at admission, when the workload has linked the turns)
            private = self.next_turn is None and type(self.segments[-1]) is tuple
            start = self._private_start = self.prompt_len - self.own_prompt_tokens if private else -1
        return start // block_size if start >= 0 else NO_PRIVATE_BLOCK

    def drop_block_hashes(self) -> None:
        """Forget the block hashes of a request that ended (they are recomputed if ever needed)."""
        self.block_hashes = []
        self._hash_cursor = (0, 0, None, 0)

    # -- content -----------------------------------------------------------------------
    def extend_block_hashes(self, num_blocks: int, block_size: int) -> None:
        """Hash full blocks up to `num_blocks`, each identifying all the content up to its end.

        A block's identity is the sequence of pieces it covers: (key, start, end) for keyed
        segments, the token ids themselves for literal ones, chained to its parent's hash. The
        chain starts from the request's salt, so different tenants never share a block. A run of
        whole blocks inside one keyed segment is numbered instead of chained: the run's first
        block fixes (parent, key, offset), which fixes the content of every later block of the
        run, so block i of the run is `base + i`, base a 56-bit hash (one C-speed range of small
        ints; two runs' ranges overlap with a chance of about their length / 2^56, the order of
        a chained 64-bit hash colliding over as many blocks). The cursor keeps the run open
        across calls, so hashes never depend on how the blocks were asked for.
        """
        hashes = self.block_hashes
        need = num_blocks - len(hashes)
        if need <= 0:
            return
        segs = self.segments
        last = len(segs) - 1
        seg_i, off, run_base, run_off = self._hash_cursor
        parent = hashes[-1] if hashes else self.salt
        while need:
            seg = segs[seg_i]
            if isinstance(seg, tuple):      # fast path: whole blocks inside one keyed segment
                key, length = seg
                whole = (length - off) // block_size
                if whole > need:
                    whole = need
                if whole:
                    if run_base is None:
                        run_base, run_off = hash((parent, key, off)) >> 8, off
                    first = run_base + (off - run_off) // block_size
                    hashes.extend(range(first, first + whole))
                    parent = hashes[-1]
                    off += whole * block_size
                    need -= whole
                if off == length and seg_i < last:     # stay on the last segment: it may grow
                    seg_i, off, run_base = seg_i + 1, 0, None
                    continue
                if not need:
                    break
            parent, seg_i, off = self._hash_spanning_block(parent, seg_i, off, block_size)
            hashes.append(parent)
            run_base = None
            need -= 1
        self._hash_cursor = (seg_i, off, run_base, run_off)

    def _hash_spanning_block(self, parent: int, seg_i: int, off: int, block_size: int) -> tuple[int, int, int]:
        """One block that spans segments or lies in a literal one: hash all its pieces."""
        segs = self.segments
        pieces: list = [parent]
        need = block_size
        while need:
            seg = segs[seg_i]
            take = min(need, segment_len(seg) - off)
            if take <= 0:
                raise ValueError(f"request {self.id}: cannot hash block {len(self.block_hashes)}, "
                                 f"its tokens are not known yet")
            if isinstance(seg, tuple):
                pieces += (seg[0], off, off + take)
            else:
                pieces += seg[off: off + take]
                pieces.append(-1)  # piece separator: literal ids are >= 0
            off += take
            need -= take
            if off == segment_len(seg) and seg_i + 1 < len(segs):
                seg_i, off = seg_i + 1, 0
        return hash(tuple(pieces)), seg_i, off

    def token_ids(self, start: int, end: int, vocab_size: int) -> np.ndarray:
        """Materialise token ids [start, end) of prompt + output (the engine's input ids)."""
        out = []
        pos = 0
        for seg in self.segments:
            n = segment_len(seg)
            lo, hi = max(start, pos), min(end, pos + n)
            if lo < hi:
                if isinstance(seg, tuple):
                    out.append(segment_tokens(seg[0], hi - pos, vocab_size)[lo - pos:])
                else:
                    out.append(np.asarray(seg[lo - pos: hi - pos], dtype=np.int64))
            pos += n
            if pos >= end:
                break
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def __repr__(self) -> str:
        return (f"Request(id={self.id}, prompt={self.prompt_len}, output={self.num_output}/"
                f"{self.output_len}, computed={self.num_computed}, status={self.status.name})")


def make_request(id: int, arrival: Optional[float], prompt: list[Segment], output_len: int,
                 seed: int = 0, tenant: Optional[str] = None, salted: bool = False,
                 priority: int = 0, is_warmup: bool = False, own_prompt_tokens: int = 0) -> Request:
    """A workload request with a scripted output segment keyed by (seed, id)."""
    salt = tenant_salt(tenant) if (salted and tenant is not None) else 0
    output = (output_keys(seed)(id), output_len)
    req = Request(id, arrival, prompt, output_len, output, tenant, salt, priority, is_warmup)
    req.own_prompt_tokens = own_prompt_tokens
    return req
