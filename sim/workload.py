"""Workload: a scenario's `workload` section -> a deterministic list of Requests.

Three sources: synthetic (an arrival process, length distributions and a prompt layout),
explicit `requests`, or a recorded `trace` (sim/traces.py). The same scenario and seed give
the same requests bit for bit in any process: each kind of random choice has its own numpy
PCG64 stream seeded through stable_key, and every segment key comes from stable_key.

Synthetic workloads
- Arrivals start conversations; a single-turn request is a conversation of one turn. The
  first arrival is one gap after t=0 (like vLLM's benchmark client): fixed = every 1/rate s,
  poisson = exponential gaps, gamma = Gamma(shape k = 1/cv^2, scale 1/(rate k)) gaps,
  offline = all at t=0. Bounded by num_requests alone, random gaps are rescaled so the last
  conversation starts at exactly n/rate, as vLLM's benchmark does to steady throughput across
  seeds. With duration_s, conversations start until duration_s (and stop early once they
  hold num_requests requests, when that is set too).
- Lengths: every distribution is a quantile function of a standard-normal score z (at
  u = Phi(z)), so one Gaussian copula correlates prompt and output lengths whatever their
  distributions. `length_correlation` is Spearman's rank correlation of the continuous
  lengths; rounding, clipping and discrete distributions pull the realised value towards 0.
  Lengths are rounded and clipped to [max(min, 1), max].
- Prompt = [shared prefix, dynamic segment] (position 'last') or [dynamic segment, shared
  prefix] (position 'first'), then the request's own part. `prompt_len` sizes the own part
  only: the shared prefix and dynamic segment come on top. A conversation carries one of the
  `groups` prefixes with probability `fraction`; the prefix keys do not depend on the tenant,
  so only a tenant's cache salt keeps tenants from sharing prefix blocks.
- Multi-turn: turn 1's own part is drawn from prompt_len (the opening message may be long),
  later turns' from multi_turn.user_len; output lengths from output_len. Turn k's prompt =
  turn k-1's segments, its scripted output segment, then a new user message. Follow-up turns
  have arrival None and hang off `prev.next_turn`; `prev.think_time` is the pre-drawn pause
  between prev finishing and the next turn arriving. Tenant, priority, shared prefix and
  dynamic segment belong to the conversation, and `req.conversation` is its index (None
  without multi_turn). num_requests counts turns: the last conversation may be cut short.
- The list is in id order, conversation by conversation with each conversation's turns
  together, so the known arrival times never decrease along it.

All sources: the first `warmup_requests` requests of the list are marked warm-up.
"""
from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from sim.core.collector import gc_paused
from sim.core.files import FILE_EXCERPT_CHARS, check_csv_header, check_csv_row, excerpt, open_text
from sim.core.request import Request, Segment, make_request, output_keys, stable_key, stable_keys, tenant_salt
from sim.lora import assign_adapters
from sim.scenario import Arrival, DynamicSegment, LengthDist, Scenario, SharedPrefix, Tenant, Workload
from sim.traces import load_trace
from sim.arrival_shape import shaped_times


class WorkloadError(ValueError):
    """A workload that cannot be built; the message names the field path or file:line."""


@dataclass
class BuiltWorkload:
    requests: list[Request]
    # What a trace excluded and why, settings the chosen source ignores, and the like.
    notes: list[str] = field(default_factory=list)


@dataclass
class StreamedWorkload:
    """A synthetic workload made one request at a time, as a run reaches it, so a million
    requests are never all alive at once. The same requests, in the same order, as `build_requests`."""
    requests: Iterator[Request]
    count: int
    min_think: float        # the shortest think time before a follow-up turn (inf: none)
    described: bool = False  # each chunk went to `stream_requests`' `describe` before it was made


def stream_requests(scenario: Scenario, describe: Optional[Callable[["DrawnRequests"], None]] = None
                    ) -> Optional[StreamedWorkload]:
    """The workload as a stream when it is synthetic; None for traces, data sets and explicit
    requests (build those whole). With `describe`, a workload whose requests `DrawnRequests` can
    list (see `describable`) hands it each chunk of requests, as arrays, before it makes them
    (`described` is then True): the manifest's description without reading every Request."""
    w = scenario.workload
    if w.trace is not None or w.requests is not None or w.dataset is not None:
        return None
    stream = _synthetic_stream(w, scenario.seed, describe if describable(w) else None)
    if w.lora is not None:
        stream.requests = assign_adapters(stream.requests, w.lora, scenario.seed)
    if w.warmup_requests:
        stream.requests = _marked_warmup(stream.requests, w.warmup_requests)
    return stream


def _marked_warmup(requests: Iterator[Request], count: int) -> Iterator[Request]:
    for i, req in enumerate(requests):
        req.is_warmup = i < count
        yield req


def build_requests(scenario: Scenario) -> list[Request]:
    """Every request of the workload, ids 0..N-1 in list order (see the module docstring)."""
    return build_workload(scenario).requests


def build_workload(scenario: Scenario) -> BuiltWorkload:
    """The requests plus notes meant for the user (nothing is excluded silently)."""
    w, seed = scenario.workload, scenario.seed
    with gc_paused():
        if w.trace is not None:
            loaded = load_trace(w.trace, seed, _salted_tenants(w), _decode_step_s(scenario),
                                f"{scenario.model.name} on {scenario.device.name}", scenario.model.vocab_size)
            built = BuiltWorkload(loaded.requests, loaded.notes + _ignored(w, "trace"))
        elif w.requests is not None:
            built = BuiltWorkload(_explicit_requests(w, seed), _ignored(w, "requests"))
        elif w.dataset is not None:
            built = BuiltWorkload(*_dataset_requests(w, seed, scenario.model.vocab_size))
        else:
            built = BuiltWorkload(_synthetic_requests(w, seed))
    if w.lora is not None:
        built.requests = list(assign_adapters(built.requests, w.lora, seed))
    _mark_warmup(built, w.warmup_requests)
    built.notes += unread_settings(scenario)
    return built


def unread_settings(scenario: Scenario) -> list[str]:
    """Notes for settings the chosen mode never reads that the schema lets pass, because a sweep over
    the modes keeps them (`process=offline,poisson` with one rate, `scheduling_policy=fcfs,priority`
    with one set of priorities): said beside the results, not dropped silently."""
    w, notes = scenario.workload, []
    if w.arrival.process == "offline" and w.arrival.rate is not None:
        notes.append(f"workload.arrival.rate {w.arrival.rate:g} is not read with process offline "
                     f"(every request is sent at t=0)")
    prioritised = w.priorities is not None or any(r.priority for r in w.requests or ())
    if prioritised and scenario.engine.scheduling_policy == "fcfs":
        notes.append("request priorities are not read with engine.scheduling_policy fcfs (first come, first "
                     "served); set it to priority to use them")
    return notes


def _decode_step_s(scenario: Scenario) -> float:
    """A lone decode step's floor: reading the weights once from memory (per GPU)."""
    from sim.core.memory import weight_bytes_per_gpu

    p = scenario.parallelism
    return weight_bytes_per_gpu(scenario.model, p.tp, p.dp) / (scenario.device.hbm_gbps * 1e9)


def _stream(seed: int, purpose: str) -> np.random.Generator:
    """One stream per purpose, so e.g. adding tenants leaves arrivals and lengths unchanged."""
    return np.random.Generator(np.random.PCG64(stable_key("workload", seed, purpose)))


def _mark_warmup(built: BuiltWorkload, count: int) -> None:
    for req in built.requests[:count]:
        req.is_warmup = True
    built.notes += warmup_notes(count, len(built.requests))


def warmup_notes(count: int, total: int) -> list[str]:
    if count and count >= total:
        return [f"workload.warmup_requests ({count}) covers all {total} requests: no steady-state request is left"]
    return []


# ----------------------------------------------------------------------------- synthetic

def _synthetic_requests(w: Workload, seed: int) -> list[Request]:
    return list(_synthetic_stream(w, seed).requests)


def _synthetic_stream(w: Workload, seed: int, describe=None) -> StreamedWorkload:
    """The random draws made (whole, or set up to be drawn a chunk at a time); the Request objects
    made as the stream is read."""
    draws = _ChunkedDraws(w, seed) if drawn_in_chunks(w) else _WholeDraws(w, seed)
    return StreamedWorkload(_made_requests(w, seed, draws, describe), draws.count, draws.min_think,
                            describe is not None)


def describable(w: Workload) -> bool:
    """Synthetic workloads whose requests `DrawnRequests` lists from the draws: single turns with
    no dynamic segment (a prompt of [shared prefix, user message] or [user message])."""
    return w.multi_turn is None and w.dynamic_segment is None


def _made_requests(w: Workload, seed: int, draws, describe=None) -> Iterator[Request]:
    # A conversation's turns are made together (and linked) before its first is given out:
    # a first turn rejected at once rejects the later ones, which must exist by then.
    tenants = w.tenants or []
    names = [t.name for t in tenants] or [None]       # (tenant_of is all 0 without tenants)
    # (make_request's salt and output key, looked up once: ~2k instructions a request)
    salt_of = [tenant_salt(t.name) if t.salt else 0 for t in tenants] or [0]
    user_key, output_key = stable_keys("user", seed), output_keys(seed)
    multi_turn = w.multi_turn is not None
    dynamic = w.dynamic_segment
    prefixes, think = draws.prefixes, draws.think
    prev: Optional[Request] = None
    turns: list[Request] = []
    rows = _keyed_rows(draws, user_key, describe, names)
    for i, (key, c, first, last, own_len, out_len, t, g, priority, start) in enumerate(rows):
        user = (key, own_len)
        if first:
            tenant, salt, arrival = names[t], salt_of[t], start
            prompt = [prefixes[g], user] if g >= 0 else [user]
            if dynamic is not None:
                _add_dynamic(prompt, dynamic, seed, c)
        else:
            arrival = None
            prompt = prev.segments + [user]
        req = Request(i, arrival, prompt, out_len, (output_key(i), out_len), tenant, salt, priority, False)
        req.own_prompt_tokens = own_len     # its user key is its own
        if not first:
            prev.next_turn, prev.think_time = req, think[i - 1]
        if multi_turn:
            req.conversation = c
        prev = req
        if not last:
            turns.append(req)
        elif first:             # a conversation of one turn
            yield req
        else:
            turns.append(req)
            yield from turns
            turns = []


def _keyed_rows(draws, user_key, describe, names: list) -> Iterator[tuple]:
    """(user message key, *the draws' row) per request, a chunk of the draws at a time; each chunk
    goes to `describe` (as DrawnRequests) before its first row is given out."""
    for lo, columns in draws.chunks():
        user_keys = [user_key(i) for i in range(lo, lo + len(columns[0]))]   # (3.11 inlines these calls; map does not)
        if describe is not None:
            describe(DrawnRequests.of_chunk(lo, columns, user_keys, names, draws.prefixes))
        yield from zip(user_keys, *(column.tolist() for column in columns))


@dataclass
class DrawnRequests:
    """A chunk of a `describable` workload's requests as the arrays `_made_requests` makes them
    from, row by row: each request's id, arrival, prompt and output lengths, tenant, priority and
    prompt segments, the values its Request is made with (the manifest's description of the
    workload, sim/predict.py, reads these instead of the Request objects). A request's prompt is
    [its group's shared prefix, (user key, own length)], or [(user key, own length)] where its
    group is -1."""
    first_id: int
    arrival: np.ndarray           # float64
    own_len: np.ndarray           # the user message's length
    output_len: np.ndarray
    tenant: np.ndarray            # an index into tenant_names
    tenant_names: list
    priority: np.ndarray
    group: np.ndarray             # the shared prefix's index in `prefixes`, -1: none
    prefixes: list                # (key, length) of each shared prefix
    user_keys: list               # each request's user message key

    @classmethod
    def of_chunk(cls, lo: int, columns: tuple, user_keys: list, names: list, prefixes: list) -> "DrawnRequests":
        """From a chunk of the draws' columns (`rows` order) starting at row `lo`."""
        _, _, _, own, output, tenant, group, priority, start = columns
        return cls(lo, start, own, output, tenant, names, priority, group, prefixes, user_keys)

    def __len__(self) -> int:
        return len(self.arrival)

    def rows(self, start: int, stop: int) -> "DrawnRequests":
        """Rows start..stop-1 of the chunk."""
        cut = slice(start, stop)
        return DrawnRequests(self.first_id + start, self.arrival[cut], self.own_len[cut], self.output_len[cut],
                             self.tenant[cut], self.tenant_names, self.priority[cut], self.group[cut],
                             self.prefixes, self.user_keys[cut])

    @property
    def prompt_len(self) -> np.ndarray:
        """The prompt's segments' lengths summed."""
        carries = self.group >= 0
        if not carries.any():
            return self.own_len
        lengths = np.array([n for _, n in self.prefixes], dtype=np.int64)
        return self.own_len + np.where(carries, lengths[np.where(carries, self.group, 0)], 0)

    def segment_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """((rows, slots, 2) int64 of the prompt's (key, length) pairs in order, (rows, slots) bool:
        does the row have that slot's segment?)."""
        n = len(self)
        user = np.stack([np.fromiter(self.user_keys, np.int64, n), self.own_len.astype(np.int64)], axis=1)
        carries = self.group >= 0
        if not carries.any():
            return user[:, None, :], np.ones((n, 1), dtype=bool)
        prefix = np.array(self.prefixes, dtype=np.int64)[np.where(carries, self.group, 0)]
        return (np.stack([np.where(carries[:, None], prefix, user), user], axis=1),
                np.stack([np.ones(n, dtype=bool), carries], axis=1))

    def figures(self) -> tuple[list[list], list[list]]:
        """(a list per figure: id, arrival, prompt_len, output_len, tenant, priority; each request's
        prompt segments, a list of (key, length) tuples): the Python values its Request holds."""
        n = len(self)
        names, tenant = self.tenant_names, self.tenant
        tenants = [names[int(tenant[0])]] * n if (tenant == tenant[0]).all() else [names[t] for t in tenant.tolist()]
        figures = [list(range(self.first_id, self.first_id + n)), self.arrival.tolist(), self.prompt_len.tolist(),
                   self.output_len.tolist(), tenants, self.priority.tolist()]
        users = list(zip(self.user_keys, self.own_len.tolist()))
        if (self.group < 0).all():
            return figures, [[user] for user in users]
        prefixes = self.prefixes
        return figures, [[prefixes[g], user] if g >= 0 else [user] for g, user in zip(self.group.tolist(), users)]


LISTED_CHUNK = 65_536


class _WholeDraws:
    """Every random draw made now, as arrays; rows listed as Python values (as tolist gives them)
    LISTED_CHUNK requests at a time (ten million requests' lists of Python numbers would hold
    gigabytes)."""

    def __init__(self, w: Workload, seed: int):
        starts, turns = _conversations(w, seed)
        n_conv = len(turns)
        self.conv = np.repeat(np.arange(n_conv), turns)
        self.opening = np.ones(len(self.conv), dtype=bool)
        self.opening[1:] = self.conv[1:] != self.conv[:-1]
        self.closing = np.ones(len(self.conv), dtype=bool)     # a conversation's last turn
        self.closing[:-1] = self.opening[1:]
        self.own, self.output = _request_lengths(w, seed, self.opening)
        self.prefixes, self.group = _prefix_groups(w.shared_prefix, seed, n_conv)
        self.tenant_of = _draw(_stream(seed, "tenants"), n_conv, [t.share for t in w.tenants or []])
        self.priority_of = _priorities(w, seed, n_conv)
        self.starts = starts
        self.think = _think_times(w, seed, len(self.conv))
        self.count = len(self.conv)
        follow_ups = np.flatnonzero(~self.opening)
        self.min_think = min(self.think[i - 1] for i in follow_ups.tolist()) if len(follow_ups) else math.inf

    def chunks(self) -> Iterator[tuple[int, tuple]]:
        """(first row, the columns of `rows`) LISTED_CHUNK rows at a time."""
        for lo in range(0, self.count, LISTED_CHUNK):
            hi = lo + LISTED_CHUNK
            c = self.conv[lo:hi]
            yield lo, (c, self.opening[lo:hi], self.closing[lo:hi], self.own[lo:hi], self.output[lo:hi],
                       self.tenant_of[c], self.group[c], self.priority_of[c], self.starts[c])

    def rows(self) -> Iterator[tuple]:
        """(conversation, first turn, last turn, own prompt part, output length, tenant index,
        prefix group, priority, conversation start) per request."""
        return _listed(self.chunks())


def drawn_in_chunks(w: Workload) -> bool:
    """Workloads whose draws are made LISTED_CHUNK requests at a time, the same values as whole
    arrays give (one conversation per request, no duration bound, a plain arrival process, lengths
    with no file to read): memory flat in the request count."""
    a = w.arrival
    return (w.multi_turn is None and w.duration_s is None and w.num_requests is not None
            and a.ramp_up is None and a.rate_schedule is None and a.diurnal is None
            and a.process in ("poisson", "gamma", "fixed", "offline")
            and "empirical" not in (w.prompt_len.dist, w.output_len.dist))


def _skipped(rng: np.random.Generator, draw, n: int) -> np.random.Generator:
    """A copy of `rng` moved past `draw`(rng, k) calls making n values (made LISTED_CHUNK at a time)."""
    import copy

    rng = copy.deepcopy(rng)
    for lo in range(0, n, LISTED_CHUNK):
        draw(rng, min(LISTED_CHUNK, n - lo))
    return rng


class _ChunkedDraws:
    """The draws of _WholeDraws, for the workloads `drawn_in_chunks` allows, made LISTED_CHUNK
    requests at a time. Each array drawn whole from a stream is drawn here in consecutive calls
    on that stream (numpy's Generator then gives the same values in the same order); where a
    stream draws two arrays one after the other, the second is drawn from a copy of the stream
    moved past the first (drawn and discarded a chunk at a time); a running sum (the arrival
    times) carries its last value into the next chunk's np.cumsum, which adds in the same order.
    tests/sim/test_workload.py holds every row to _WholeDraws'."""

    def __init__(self, w: Workload, seed: int):
        self.w, self.seed = w, seed
        self.count = w.num_requests
        self.min_think, self.think = math.inf, None
        sp = w.shared_prefix
        self.prefixes, self._groups = ([], None) if sp is None else _prefix_setup(sp, seed)
        self._scale = self._arrival_scale()       # (raising what _conversations raises, before the run)

    def _gaps(self, rng: np.random.Generator, k: int) -> np.ndarray:
        a = self.w.arrival
        if a.process == "poisson":
            return rng.exponential(1.0 / a.rate, k)
        shape = 1.0 / a.cv ** 2
        return rng.gamma(shape, 1.0 / (a.rate * shape), k)

    def _times(self) -> Iterator[np.ndarray]:
        """_process_times' running sums, a chunk at a time."""
        rng, last = _stream(self.seed, "arrivals"), None
        for lo in range(0, self.count, LISTED_CHUNK):
            gaps = self._gaps(rng, min(LISTED_CHUNK, self.count - lo))
            times = np.cumsum(gaps) if last is None else np.cumsum(np.concatenate([[last], gaps]))[1:]
            last = times[-1]
            yield times

    def _arrival_scale(self):
        """_arrival_times' rescaling factor (None: none), from a first pass over the times."""
        a, n = self.w.arrival, self.count
        if a.process not in ("poisson", "gamma"):
            return None
        last = None
        for times in self._times():
            last = times[-1]
        if a.process == "gamma" and not last > 0:
            raise WorkloadError(f"workload.arrival: cv {a.cv:g} gives {n} arrivals all at t=0 "
                                f"(every gamma gap underflows); use a smaller cv or process: offline")
        return n / a.rate / last if a.rescale else None

    def _starts(self) -> Iterator[np.ndarray]:
        a = self.w.arrival
        if a.process in ("offline", "fixed"):
            for lo in range(0, self.count, LISTED_CHUNK):
                hi = min(lo + LISTED_CHUNK, self.count)
                yield np.zeros(hi - lo) if a.process == "offline" else np.arange(lo + 1, hi + 1) / a.rate
            return
        for times in self._times():
            if self._scale is not None:
                times *= self._scale
            yield times

    def rows(self) -> Iterator[tuple]:
        return _listed(self.chunks())

    def chunks(self) -> Iterator[tuple[int, tuple]]:
        """(first row, _WholeDraws' columns of its rows) LISTED_CHUNK rows at a time, drawn then."""
        w, seed, n = self.w, self.seed, self.count
        rho = 2.0 * math.sin(math.pi * w.length_correlation / 6.0)
        normals = (lambda rng, k: rng.standard_normal(k))          # noqa: E731
        z_prompt_rng = _stream(seed, "lengths")
        z_output_rng = _skipped(z_prompt_rng, normals, n)
        tenants = [t.share for t in w.tenants or []]
        tenant_rng, priority_rng = _stream(seed, "tenants"), _stream(seed, "priorities")
        if self._groups is not None:
            group_rng, p = self._groups
            draw_groups = (lambda rng, k: rng.choice(w.shared_prefix.groups, size=k, p=p))   # noqa: E731
            carry_rng = _skipped(group_rng, draw_groups, n)
        for lo, starts in zip(range(0, n, LISTED_CHUNK), self._starts()):
            k = len(starts)
            z_prompt = z_prompt_rng.standard_normal(k)
            z_output = rho * z_prompt + math.sqrt(max(0.0, 1.0 - rho * rho)) * z_output_rng.standard_normal(k)
            own = _lengths(w.prompt_len, z_prompt, "workload.prompt_len", "prompt")
            output = _lengths(w.output_len, z_output, "workload.output_len", "output")
            if self._groups is None:
                group = np.full(k, -1)
            else:
                chosen = draw_groups(group_rng, k)
                group = np.where(carry_rng.random(k) < w.shared_prefix.fraction, chosen, -1)
            conv = np.arange(lo, lo + k)
            ones = np.ones(k, dtype=bool)
            yield lo, (conv, ones, ones, own, output, _draw(tenant_rng, k, tenants),
                       group, _priorities_drawn(w, priority_rng, k), starts)


def _listed(chunks: Iterator[tuple[int, tuple]]) -> Iterator[tuple]:
    """The rows of the draws' chunks as Python values (as tolist gives them)."""
    for _, columns in chunks:
        yield from zip(*(column.tolist() for column in columns))


def _conversations(w: Workload, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Start time and number of turns of each conversation."""
    arrivals, turns_rng = _stream(seed, "arrivals"), _stream(seed, "turns")
    if w.duration_s is None:
        turns = _cut_to(w.num_requests, _turn_counts(w, turns_rng, w.num_requests))
        return _arrival_times(w.arrival, arrivals, len(turns), None), turns
    starts = _arrival_times(w.arrival, arrivals, w.num_requests, w.duration_s)
    if len(starts) == 0:
        raise WorkloadError(f"workload.duration_s: no request arrives within {w.duration_s:g} s "
                            f"at workload.arrival.rate {w.arrival.mean_rate:g}/s")
    turns = _turn_counts(w, turns_rng, len(starts))
    if w.num_requests is not None:
        turns = _cut_to(w.num_requests, turns)
    return starts[: len(turns)], turns


def _turn_counts(w: Workload, rng: np.random.Generator, n: int) -> np.ndarray:
    if w.multi_turn is None:
        return np.ones(n, dtype=np.int64)
    return _lengths(w.multi_turn.turns, rng.standard_normal(n), "workload.multi_turn.turns", "turns")


def _cut_to(num_requests: int, turns: np.ndarray) -> np.ndarray:
    """The leading conversations that hold num_requests requests; the last may lose turns."""
    ends = np.cumsum(turns)
    if ends[-1] <= num_requests:
        return turns
    n_conv = int(np.searchsorted(ends, num_requests)) + 1
    turns = turns[:n_conv].copy()
    turns[-1] -= ends[n_conv - 1] - num_requests
    return turns


def _arrival_times(arrival: Arrival, rng: np.random.Generator, count: Optional[int],
                   duration: Optional[float]) -> np.ndarray:
    if arrival.process == "offline":
        return np.zeros(count)
    if arrival.ramp_up is not None:       # the schema ensures count is set and duration is not
        return _ramp_times(arrival, rng, count)
    if arrival.rate_schedule is not None or arrival.diurnal is not None:
        return shaped_times(arrival, rng, count, duration)
    if duration is None:
        times = _process_times(arrival, rng, count)
        if arrival.process not in ("fixed", "vidur_poisson") and arrival.rescale:
            times *= count / arrival.rate / times[-1]   # vLLM bench: last one at exactly n/rate
        return times
    expected = int(duration * arrival.rate * 1.1) + 16
    times = _process_times(arrival, rng, expected if count is None else min(expected, count))
    while times[-1] < duration and (count is None or len(times) < count):
        if arrival.process == "vidur_poisson":        # one stream from its seed: draw it longer
            times = _process_times(arrival, rng, 2 * len(times))
            continue
        times = np.concatenate([times, times[-1] + _process_times(arrival, rng, len(times))])
    return times[times < duration][:count]


def _ramp_times(arrival: Arrival, rng: np.random.Generator, n: int) -> np.ndarray:
    """vLLM bench's ramp-up: gap i drawn at request i's rate; no rescaling."""
    ramp = arrival.ramp_up
    progress = np.arange(n) / max(n - 1, 1)
    if ramp.strategy == "linear":
        rates = ramp.start_rps + (ramp.end_rps - ramp.start_rps) * progress
    else:
        rates = ramp.start_rps * (ramp.end_rps / ramp.start_rps) ** progress
    if arrival.process == "fixed":
        gaps = 1.0 / rates
    elif arrival.process == "poisson":
        gaps = rng.exponential(1.0, n) / rates
    else:
        shape = 1.0 / arrival.cv ** 2
        gaps = rng.gamma(shape, 1.0, n) / (rates * shape)
    return np.cumsum(gaps)


def _process_times(arrival: Arrival, rng: np.random.Generator, n: int) -> np.ndarray:
    """The first n arrival times of the process started at t=0."""
    rate = arrival.rate
    if arrival.process == "fixed":
        return np.arange(1, n + 1) / rate
    if arrival.process == "poisson":
        return np.cumsum(rng.exponential(1.0 / rate, n))
    if arrival.process == "vidur_poisson":
        return _vidur_poisson_times(rate, arrival.seed, n)
    shape = 1.0 / arrival.cv ** 2
    times = np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), n))
    if not times[-1] > 0:       # a huge cv: every gap underflowed to 0 (and time would never advance)
        raise WorkloadError(f"workload.arrival: cv {arrival.cv:g} gives {n} arrivals all at t=0 "
                            f"(every gamma gap underflows); use a smaller cv or process: offline")
    return times


def _vidur_poisson_times(rate: float, seed: int, n: int) -> np.ndarray:
    """Vidur's synthetic arrivals, bit for bit: its own Python `random` stream, capped gaps,
    a running float sum (the same operations in the same order as Vidur)."""
    rnd = random.Random(seed)
    cap = (1.0 / rate) * 3.0
    times = np.empty(n)
    t = 0.0
    for i in range(n):
        t = t + min(-math.log(1.0 - rnd.random()) / rate, cap)
        times[i] = t
    return times


def _request_lengths(w: Workload, seed: int, opening: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Own prompt part and output length of each request, through one Gaussian copula."""
    rng = _stream(seed, "lengths")
    n = len(opening)
    z_prompt = rng.standard_normal(n)
    rho = 2.0 * math.sin(math.pi * w.length_correlation / 6.0)   # Spearman's r -> normal rho
    z_output = rho * z_prompt + math.sqrt(max(0.0, 1.0 - rho * rho)) * rng.standard_normal(n)
    own = np.empty(n, dtype=np.int64)
    own[opening] = _lengths(w.prompt_len, z_prompt[opening], "workload.prompt_len", "prompt")
    if not opening.all():
        own[~opening] = _lengths(w.multi_turn.user_len, z_prompt[~opening],
                                 "workload.multi_turn.user_len", "prompt")
    return own, _lengths(w.output_len, z_output, "workload.output_len", "output")


def _prefix_groups(sp: Optional[SharedPrefix], seed: int, n_conv: int) -> tuple[list[Segment], np.ndarray]:
    """The shared prefixes, and each conversation's prefix group (-1: none)."""
    if sp is None:
        return [], np.full(n_conv, -1)
    prefixes, (rng, p) = _prefix_setup(sp, seed)
    group = rng.choice(sp.groups, size=n_conv, p=p)
    carries = rng.random(n_conv) < sp.fraction
    return prefixes, np.where(carries, group, -1)


def _prefix_setup(sp: SharedPrefix, seed: int) -> tuple[list[Segment], tuple[np.random.Generator, np.ndarray]]:
    """The shared prefixes, and (the stream that then draws each conversation's group, the groups'
    probabilities)."""
    rng = _stream(seed, "shared_prefix")
    lengths = _lengths(sp.length, rng.standard_normal(sp.groups), "workload.shared_prefix.length", "prompt")
    prefixes = [(stable_key("prefix", seed, g), n) for g, n in enumerate(lengths.tolist())]
    rank = np.arange(1, sp.groups + 1, dtype=np.float64)
    popularity = rank ** -sp.zipf_s if sp.popularity == "zipf" else np.ones(sp.groups)
    return prefixes, (rng, popularity / popularity.sum())


def _add_dynamic(prompt: list[Segment], dyn: DynamicSegment, seed: int, conv: int) -> None:
    """Put a conversation's dynamic segment into its first prompt, [shared prefix, user message]
    or [user message]: first, or last before the user message."""
    segment = (stable_key("dynamic", seed, conv), dyn.length)
    prompt.insert(0 if dyn.position == "first" else len(prompt) - 1, segment)


def _priorities(w: Workload, seed: int, n_conv: int) -> np.ndarray:
    return _priorities_drawn(w, _stream(seed, "priorities"), n_conv)


def _priorities_drawn(w: Workload, rng: np.random.Generator, n: int) -> np.ndarray:
    if w.priorities is None:
        return np.zeros(n, dtype=np.int64)
    p = w.priorities
    return np.asarray(p.values)[_draw(rng, n, p.weights or [1.0] * len(p.values))]


def _draw(rng: np.random.Generator, n: int, weights: list[float]) -> np.ndarray:
    """n indices drawn by weight (the schema guarantees weights >= 0 with a positive sum)."""
    if len(weights) <= 1:
        return np.zeros(n, dtype=np.int64)
    w = np.asarray(weights, dtype=np.float64)
    return rng.choice(len(w), size=n, p=w / w.sum())


def _think_times(w: Workload, seed: int, n: int) -> list[float]:
    mt = w.multi_turn
    if mt is None:
        return [0.0] * n
    if mt.think_dist == "fixed":
        return [mt.think_time_s] * n
    return _stream(seed, "think").exponential(mt.think_time_s, n).tolist()


# ----------------------------------------------------------------------------- lengths

def _sharegpt(role: str, where: str) -> tuple[float, float, int, int]:
    """The `sharegpt` preset: (mean, std, min, max) of a rounded, clipped lognormal length.

    An APPROXIMATION of ShareGPT (V3 unfiltered, cleaned split) after vLLM's benchmark
    filtering (drops prompt < 4, output < 4, prompt > 1024, prompt + output > 2048), not the
    data set itself:
      prompt: lognormal mean 240, std 300 tokens, clipped to [4, 1024] -> mean ~227, median ~150
      output: lognormal mean 205, std 210 tokens, clipped to [4, 1024] -> mean ~201, median ~143
    The means match the totals vLLM's benchmark reports for 1000 sampled ShareGPT prompts
    (~230k input and ~200k output tokens, Llama-3 tokenizer); the shapes are not fitted.
    Prompt and output lengths are independent unless length_correlation is set.
    """
    return (205.0, 210.0, 4, 1024) if role == "output" else (240.0, 300.0, 4, 1024)


_erf = np.frompyfunc(math.erf, 1, 1)


def _phi(z: np.ndarray) -> np.ndarray:
    """The standard normal CDF (no scipy)."""
    return 0.5 * (1.0 + _erf(z / math.sqrt(2.0)).astype(np.float64))


def _lognormal(mean: float, std: float, z: np.ndarray) -> np.ndarray:
    """Lognormal with this mean and std of the length itself (not of its logarithm)."""
    sigma2 = math.log1p((std / mean) ** 2)
    return np.exp(math.log(mean) - sigma2 / 2 + math.sqrt(sigma2) * z)


def _lengths(dist: LengthDist, z: np.ndarray, where: str, role: str) -> np.ndarray:
    """Lengths at standard-normal scores z: the distribution's quantile at Phi(z)."""
    lo, hi = 1, math.inf
    if dist.dist == "fixed":
        x = np.full(len(z), float(dist.value))
    elif dist.dist == "uniform":
        x = dist.min + np.floor(_phi(z) * (dist.max - dist.min + 1))
    elif dist.dist == "normal":
        x = dist.mean + dist.std * z
    elif dist.dist == "lognormal":
        x = _lognormal(dist.mean, dist.std, z)
    elif dist.dist == "empirical":
        values = np.sort(_empirical_values(dist, where)).astype(np.float64)
        x = values[np.minimum((_phi(z) * len(values)).astype(np.int64), len(values) - 1)]
    else:
        mean, std, lo, hi = _sharegpt(role, where)
        x = _lognormal(mean, std, z)
    lo = max(dist.min if dist.min is not None else lo, 1)
    hi = dist.max if dist.max is not None else hi
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def _empirical_values(dist: LengthDist, where: str) -> np.ndarray:
    if dist.file is not None:
        return _read_lengths(Path(dist.file), dist.column, where)
    bad = [i for i, v in enumerate(dist.values) if v < 0]
    if not dist.values or bad:
        what = f"values[{bad[0]}] is {dist.values[bad[0]]}" if bad else "values is empty"
        raise WorkloadError(f"{where}.{what}; expected token lengths >= 0")
    return np.asarray(dist.values, dtype=np.int64)


def _read_lengths(path: Path, column: Optional[str], where: str) -> np.ndarray:
    """Lengths from a CSV column, or from a plain file with one whole number per line."""
    if not path.is_file():
        raise WorkloadError(f"{where}.file: no such file: {path}")
    with open_text(path, f"length file ({where}.file)") as f:
        if column is None:
            expected = "one whole number >= 0 per line (for a CSV, give `column`)"
            items = [(n, text.strip()) for n, text in enumerate(f, start=1) if text.strip()]
        else:
            expected = f"a whole number >= 0 in column {column!r}"
            reader = csv.reader(f)
            try:
                header = next(reader, [])
                if column not in header:
                    raise WorkloadError(f"{path}:1: no column {excerpt(column)} (columns: "
                                        f"{excerpt(', '.join(header)[:200], 3 * FILE_EXCERPT_CHARS)}; {where}.column)")
                check_csv_header(path, header, [column], WorkloadError)
                index = header.index(column)
                items = []
                for row in reader:
                    if row:        # csv.DictReader's rule: a blank line is no row
                        check_csv_row(path, reader.line_num, row, header, WorkloadError)
                        items.append((reader.line_num, row[index].strip()))
            except csv.Error as e:     # a field over csv's 128 KiB limit, a NUL byte
                raise WorkloadError(f"{path}:{reader.line_num}: not a valid CSV row ({e})") from None
    if not items:
        raise WorkloadError(f"{path}: no lengths in the file ({where}.file)")
    return np.array([_whole(text, f"{path}:{line}", expected) for line, text in items], dtype=np.int64)


def _whole(text: str, where: str, expected: str) -> int:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value < 2**53 and value == int(value)):
        raise WorkloadError(f"{where}: {excerpt(text, FILE_EXCERPT_CHARS)} is not a token length; expected {expected}")
    return int(value)


# ----------------------------------------------------------------------------- data sets

def _dataset_requests(w: Workload, seed: int, vocab_size: int) -> tuple[list[Request], list[str]]:
    """Requests whose prompts come from `workload.dataset`, arriving as `workload.arrival` says;
    a multi-turn conversation's later turns follow its earlier ones (think_time_s after each)."""
    from sim.datasets import DatasetError

    ds = w.dataset
    rng = _stream(seed, "dataset")
    try:
        draw, notes, vocab = _dataset_source(w, seed, rng)
    except DatasetError as e:
        raise WorkloadError(str(e)) from None
    if vocab is not None and vocab > vocab_size:
        raise WorkloadError(f"workload.dataset.tokenizer: {vocab} tokens, more than the model's vocab_size "
                            f"({vocab_size}): its ids would not be valid prompts for this model")
    arrivals = _stream(seed, "arrivals")
    if w.duration_s is None:
        convs = draw(w.num_requests)
        turns = _cut_to(w.num_requests, np.array([len(c) for c in convs]))
        starts = _arrival_times(w.arrival, arrivals, len(turns), None)
    else:
        starts = _arrival_times(w.arrival, arrivals, w.num_requests, w.duration_s)
        if len(starts) == 0:
            raise WorkloadError(f"workload.duration_s: no request arrives within {w.duration_s:g} s")
        convs = draw(len(starts))
        turns = np.array([len(c) for c in convs])
        if w.num_requests is not None:
            turns = _cut_to(w.num_requests, turns)
        starts = starts[: len(turns)]
    requests: list[Request] = []
    for c, (start, n) in enumerate(zip(starts.tolist(), turns.tolist())):
        prev = None
        for prompt, output_len in convs[c][:n]:
            i = len(requests)
            segments = prompt if prev is None else prev.segments + prompt
            req = make_request(i, start if prev is None else None, segments, output_len, seed=seed)
            if prev is not None:
                prev.next_turn, prev.think_time = req, ds.think_time_s
            if ds.turns == "all" and ds.format == "sharegpt":
                req.conversation = c
            requests.append(req)
            prev = req
    return requests, notes


def _dataset_source(w: Workload, seed: int, rng: np.random.Generator):
    """(draw(k) -> k conversations of (prompt segments, output length), notes, tokenizer vocabulary)."""
    from sim.datasets import load_prompts, sonnet_lines

    ds = w.dataset
    if ds.format == "random":
        return _random_set(ds, seed, rng), [], None
    if ds.format == "sonnet":
        base, lines, notes, vocab = sonnet_lines(ds)
        return _sonnet_set(ds, base, lines, rng), notes, vocab
    prompts, vocab = load_prompts(ds)
    pool = prompts.conversations

    def draw(k: int) -> list:
        order = np.concatenate([rng.permutation(len(pool)) for _ in range(-(-k // len(pool)))])[:k]
        # text files record no answers: their output lengths come from workload.output_len
        fallback = _lengths(w.output_len, rng.standard_normal(k), "workload.output_len", "output")
        return [[([t.prompt], ds.output_len or t.answer_len or int(fallback[n])) for t in pool[j]]
                for n, j in enumerate(order.tolist())]

    notes = list(prompts.notes)
    if w.num_requests and w.num_requests > len(pool):
        notes.append(f"workload.dataset: {len(pool)} usable conversations for {w.num_requests} requests: drawn "
                     f"again once all were used")
    return draw, notes, vocab


def _random_set(ds, seed: int, rng: np.random.Generator):
    """vLLM's random set: lengths uniform in [L(1-r), L(1+r)] after a prefix every request shares."""
    output = ds.output_len or 128

    def draw(k: int) -> list:
        def uniform(length: int) -> np.ndarray:
            lo, hi = max(int(length * (1 - ds.range_ratio)), 1), int(math.ceil(length * (1 + ds.range_ratio)))
            return rng.integers(lo, hi + 1, k)
        ins, outs = uniform(ds.input_len), uniform(output)
        prefix = [(stable_key("dataset-prefix", seed), ds.prefix_len)] if ds.prefix_len else []
        return [[(prefix + [(stable_key("dataset", seed, i), int(n))], int(o))]
                for i, (n, o) in enumerate(zip(ins.tolist(), outs.tolist()))]
    return draw


def _sonnet_set(ds, base: list[int], lines: list[list[int]], rng: np.random.Generator):
    """vLLM's sonnet set: the base prompt, the poem's first lines (about prefix_len tokens, shared),
    then lines drawn at random until about input_len tokens; fixed output length (150)."""
    mean_line = float(np.mean([len(line) for line in lines]))
    n_input = max(round((ds.input_len - len(base)) / mean_line), 1)
    n_prefix = min(max(round((ds.prefix_len - len(base)) / mean_line), 0), n_input)
    head = base + [t for line in lines[:n_prefix] for t in line]
    output = ds.output_len or 150

    def draw(k: int) -> list:
        picks = rng.integers(0, len(lines), (k, n_input - n_prefix))
        return [[([head + [t for j in row for t in lines[j]]], output)] for row in picks.tolist()]
    return draw


# ----------------------------------------------------------------------------- explicit, trace

def _tenant_table(w: Workload) -> Optional[dict[str, Tenant]]:
    return None if w.tenants is None else {t.name: t for t in w.tenants}   # names are unique (schema)


def _explicit_requests(w: Workload, seed: int) -> list[Request]:
    """Requests as written; equal segment names mean equal tokens across requests."""
    specs = w.requests
    if not specs:
        raise WorkloadError("workload.requests: empty; expected at least one request")
    tenants = _tenant_table(w)
    unknown = [f"workload.requests[{i}].tenant: {r.tenant!r} is not in workload.tenants "
               f"(known: {', '.join(tenants)})"
               for i, r in enumerate(specs) if tenants is not None and r.tenant not in (None, *tenants)]
    if unknown:
        raise WorkloadError("\n".join(unknown))
    order = sorted(range(len(specs)), key=lambda i: (specs[i].arrival_s, i))
    requests = []
    for new_id, i in enumerate(order):
        r = specs[i]
        if r.prompt is not None:
            prompt = [(stable_key("named", s.segment), s.len) for s in r.prompt]
        else:
            prompt = [(stable_key("user", seed, new_id), r.prompt_len)]
        salted = bool(tenants and r.tenant and tenants[r.tenant].salt)
        requests.append(make_request(new_id, r.arrival_s, prompt, r.output_len, seed=seed,
                                     tenant=r.tenant, salted=salted, priority=r.priority))
    return requests


def _salted_tenants(w: Workload) -> frozenset[str]:
    table = _tenant_table(w) or {}
    return frozenset(name for name, t in table.items() if t.salt)


def _ignored(w: Workload, source: str) -> list[str]:
    """Notes for settings that the chosen source cannot honour (the schema rejects the rest)."""
    if source == "trace" and w.tenants and w.trace.format != "jsonl":
        return [f"workload.tenants is ignored with a {w.trace.format} trace (it names no tenants)"]
    return []
