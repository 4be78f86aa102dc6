"""The simulator's clock lands on exact step sums through SimPy's public timeout alone."""
import random

import pytest
import simpy

from sim.simulator import sleep_until, timeout_at


def _land(start: float, when: float) -> tuple[float, int]:
    """Where SimPy's clock is after sleep_until(when) from `start`, and how many timeouts it took."""
    env = simpy.Environment(initial_time=start)
    hops = []

    def sleeper():
        for event in sleep_until(env, when):
            hops.append(event)
            yield event

    env.process(sleeper())
    env.run()
    return env.now, len(hops)


def test_the_documented_unreachable_sum_is_reached():
    """From 0.13319044464948654 no float delay reaches 0.9392256727552156 in one add (every
    now + d rounds to an even multiple of the ulp there); sleep_until still lands on it."""
    now, target = 0.13319044464948654, 0.9392256727552156
    assert all(now + d != target for d in (target - now, 0.8060352281057291,
                                           0.806035228105729, 0.8060352281057292))
    assert _land(now, target) == (target, 2)     # to 2 * now, then one exact delay


def test_a_reachable_time_takes_one_timeout():
    assert _land(1.0, 1.7) == (1.7, 1)
    assert _land(0.0, 3.25) == (3.25, 1)
    assert _land(2.5, 2.5) == (2.5, 1)


def test_random_step_sums_are_always_landed_on_exactly():
    rng = random.Random(7)
    for _ in range(2000):
        start = rng.random() * 10 ** rng.randint(-6, 2)
        end = start
        for _ in range(rng.randint(1, 50)):
            end += rng.random() * 10 ** rng.randint(-4, 1)
        landed, hops = _land(start, end)
        assert landed == end
        assert hops <= 64


def test_a_time_in_the_past_is_refused():
    env = simpy.Environment(initial_time=2.0)
    with pytest.raises(ValueError, match="before now"):
        timeout_at(env, 1.0)
