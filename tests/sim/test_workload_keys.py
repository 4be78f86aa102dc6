"""The synthetic workload's keys, made the fast way (`stable_keys`, cached salts), are exactly the
keys of their definition: blake2b over repr(parts). Segment keys feed block hashes and token ids,
so a different value would change every prediction."""
import enum
import hashlib

import numpy as np
import pytest

from sim.core.request import stable_key, stable_keys
from sim.scenario import validate_scenario
from sim.workload import build_requests, stream_requests


def defined_key(*parts):
    """stable_key as defined: the 63 high bits of an 8-byte blake2b of repr(parts)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


class Level(enum.IntEnum):
    HIGH = 3


@pytest.mark.parametrize("head", [("user", 0), ("output", 7), ("x",), (("a",),), ("t", "s", 1.5),
                                  (None,), (0,), ("output", True), ("o", np.int64(3)), ("k", -2)])
def test_stable_keys_gives_the_defined_key_for_any_last_part(head):
    key = stable_keys(*head)
    for last in [0, 1, -5, 10**20, 2**63, True, False, Level.HIGH, np.int64(4), "7", 3.0,
                 *range(0, 10**6, 99991)]:
        assert key(last) == stable_key(*head, last) == defined_key(*head, last), (head, last)


SCENARIOS = {
    "single turn, shared prefixes": dict(num_requests=400, prompt_len={"dist": "sharegpt"},
                                         shared_prefix={"groups": 4, "length": 64, "fraction": 0.8}),
    "multi-turn, salted tenants, priorities, dynamic first": dict(
        num_requests=400, arrival={"process": "gamma", "rate": 20, "cv": 2},
        shared_prefix={"groups": 3, "fraction": 0.7, "popularity": "zipf"},
        dynamic_segment={"length": 8, "position": "first"},
        multi_turn={"turns": {"dist": "uniform", "min": 1, "max": 5}},
        tenants=[{"name": "a"}, {"name": "b", "share": 2, "salt": False}, {"name": "c", "salt": True}],
        priorities={"values": [0, 1, 2], "weights": [1, 2, 3]}, warmup_requests=10),
    "multi-turn, dynamic last, no prefix": dict(
        num_requests=300, dynamic_segment={"length": 5, "position": "last"},
        multi_turn={"turns": {"dist": "uniform", "min": 2, "max": 3}, "think_dist": "fixed"}),
}


def check_against_definition(requests, seed, tenants):
    salted = {t["name"]: t.get("salt", True) for t in tenants}
    prev_of = {r.next_turn.id: r for r in requests if r.next_turn is not None}
    for i, r in enumerate(requests):
        assert r.id == i
        *prompt, output = r.segments
        assert output == (defined_key("output", seed, i), r.output_len)
        assert prompt[-1] == (defined_key("user", seed, i), r.own_prompt_tokens)
        assert r.salt == (defined_key("tenant", r.tenant) if r.tenant is not None and salted[r.tenant] else 0)
        prev = prev_of.get(i)
        if prev is None:        # a first turn: its head is keyed prefix and dynamic segments only
            assert r.arrival is not None
            dynamic = [defined_key("dynamic", seed, r.conversation if r.conversation is not None else i)]
            prefixes = [defined_key("prefix", seed, g) for g in range(4)]
            assert all(key in dynamic + prefixes for key, _ in prompt[:-1])
        else:                   # a follow-up: the previous turn's segments, then its own message
            assert r.arrival is None and prompt[:-1] == prev.segments
            assert (r.tenant, r.salt, r.priority, r.conversation) == \
                   (prev.tenant, prev.salt, prev.priority, prev.conversation)


def signature(requests):
    return [(r.id, r.arrival, r.segments, r.prompt_len, r.output_len, r.own_prompt_tokens, r.tenant,
             r.salt, r.priority, r.think_time, r.conversation, r.is_warmup,
             r.next_turn.id if r.next_turn else None) for r in requests]


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.parametrize("seed", [0, 5])
def test_synthetic_keys_are_their_definition_and_streamed_equals_built(name, seed):
    scenario = validate_scenario({"model": "tiny", "device": "cpu", "workload": SCENARIOS[name], "seed": seed})
    built = build_requests(scenario)
    check_against_definition(built, seed, SCENARIOS[name].get("tenants", []))
    assert signature(list(stream_requests(scenario).requests)) == signature(built)
    if "tenants" in SCENARIOS[name]:      # the scenario exercises what it claims to
        assert {r.tenant for r in built} == {"a", "b", "c"} and {r.priority for r in built} == {0, 1, 2}
        assert any(r.next_turn for r in built) and any(r.salt for r in built)
