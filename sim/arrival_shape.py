"""Arrival rates that vary over time: a piecewise-constant `rate_schedule` or a `diurnal` cosine.

Both repeat with their period (a schedule's total length, a diurnal shape's period_s), so one
day's shape covers a week-long duration_s. Arrivals are a renewal process run in *operational
time* and mapped through the inverse of the cumulative rate Lambda(t) = integral of rate(u) du
(inversion): a unit-rate Poisson process becomes a non-homogeneous Poisson process of rate(t),
fixed gaps become equal steps of Lambda (one arrival per 1/rate(t) s locally), and gamma gaps
keep their burstiness cv. Bounded by num_requests alone, `rescale` puts the last arrival where
Lambda reaches N, as it puts a constant rate's at N / rate. Every draw is made in operational time, so the same seed gives the same
arrivals bit for bit, and changing the shape only moves them.

A schedule's Lambda is piecewise linear and inverts exactly; the diurnal Lambda is inverted by
bisection to the last bit of a float (60 halvings of one period).
"""
from __future__ import annotations

import math
from typing import Optional

from pydantic import Field, model_validator

from sim.core.catalog import StrictModel

MAX_RATE = 1e7
MAX_PERIOD_S = 30 * 86400.0
MAX_STEPS = 10_000
BISECTION_STEPS = 60


class RateStep(StrictModel):
    duration_s: float = Field(gt=0, le=MAX_PERIOD_S, description="how long this rate holds, s")
    rate: float = Field(ge=0, le=MAX_RATE, description="requests per second during the step (0: none)")


class Diurnal(StrictModel):
    """rate(t) = trough + (peak - trough) (1 + cos(2 pi (t - peak_at_s) / period_s)) / 2."""

    period_s: float = Field(default=86400.0, gt=0, le=MAX_PERIOD_S, description="one cycle, s (a day: 86400)")
    peak_rps: float = Field(gt=0, le=MAX_RATE, description="the highest rate, req/s, at peak_at_s")
    trough_rps: float = Field(ge=0, le=MAX_RATE, description="the lowest rate, req/s, half a period from the peak")
    peak_at_s: Optional[float] = Field(
        default=None, ge=0, le=MAX_PERIOD_S,
        description="when in the cycle the peak falls, s (default: the middle of the period)")

    @model_validator(mode="after")
    def _order(self) -> "Diurnal":
        if self.trough_rps > self.peak_rps:
            raise ValueError(f"trough_rps ({self.trough_rps:g}) is above peak_rps ({self.peak_rps:g})")
        if self.peak_at_s is not None and self.peak_at_s > self.period_s:
            raise ValueError(f"peak_at_s ({self.peak_at_s:g}) is past the end of period_s ({self.period_s:g})")
        return self

    @property
    def peak_time(self) -> float:
        return self.period_s / 2 if self.peak_at_s is None else self.peak_at_s


class RateShape:
    """rate(t), Lambda(t) and its inverse for one shape (a schedule or a diurnal cosine)."""

    def __init__(self, schedule: Optional[list[RateStep]] = None, diurnal: Optional[Diurnal] = None):
        import numpy as np

        self.diurnal = diurnal
        if schedule is not None:
            self.starts = np.concatenate(([0.0], np.cumsum([s.duration_s for s in schedule])))
            self.rates = np.array([s.rate for s in schedule])
            self.cum = np.concatenate(([0.0], np.cumsum(self.rates * np.diff(self.starts))))
            self.period = float(self.starts[-1])
            self.total = float(self.cum[-1])
        else:
            self.period = diurnal.period_s
            self.total = (diurnal.peak_rps + diurnal.trough_rps) / 2 * self.period

    @property
    def mean_rate(self) -> float:
        return self.total / self.period

    def rate(self, t):
        """The rate at times t (an array), req/s."""
        import numpy as np

        t = np.mod(np.asarray(t, dtype=float), self.period)
        if self.diurnal is None:
            return self.rates[np.minimum(np.searchsorted(self.starts, t, side="right") - 1, len(self.rates) - 1)]
        d = self.diurnal
        return d.trough_rps + (d.peak_rps - d.trough_rps) * (1 + np.cos(2 * math.pi * (t - d.peak_time) / self.period)) / 2

    def cumulative(self, t):
        """Lambda(t): the expected number of arrivals in [0, t]."""
        import numpy as np

        t = np.asarray(t, dtype=float)
        cycles = np.floor(t / self.period)
        return cycles * self.total + self._within(t - cycles * self.period)

    def _within(self, t):
        import numpy as np

        if self.diurnal is None:
            k = np.minimum(np.searchsorted(self.starts, t, side="right") - 1, len(self.rates) - 1)
            return self.cum[k] + self.rates[k] * (t - self.starts[k])
        d = self.diurnal
        w = 2 * math.pi / self.period
        swing = (d.peak_rps - d.trough_rps) / 2
        return d.trough_rps * t + swing * (t + (np.sin(w * (t - d.peak_time)) + math.sin(w * d.peak_time)) / w)

    def inverse(self, u):
        """The times at which Lambda reaches u (an increasing array of operational times > 0)."""
        import numpy as np

        u = np.asarray(u, dtype=float)
        cycles = np.maximum(np.ceil(u / self.total) - 1, 0)      # remainder in (0, total]
        rest = u - cycles * self.total
        return cycles * self.period + self._inverse_within(rest)

    def _inverse_within(self, rest):
        import numpy as np

        if self.diurnal is None:
            # the first step whose end reaches `rest`: never a zero-rate step (its Lambda is flat)
            k = np.minimum(np.searchsorted(self.cum[1:], rest, side="left"), len(self.rates) - 1)
            return self.starts[k] + (rest - self.cum[k]) / np.where(self.rates[k] > 0, self.rates[k], 1.0)
        lo, hi = np.zeros_like(rest), np.full_like(rest, self.period)
        for _ in range(BISECTION_STEPS):
            mid = (lo + hi) / 2
            below = self._within(mid) < rest
            lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
        return hi


def shape_of(arrival) -> Optional[RateShape]:
    """The arrival's time-varying shape, None for a constant rate."""
    if arrival.rate_schedule is not None or arrival.diurnal is not None:
        return RateShape(arrival.rate_schedule, arrival.diurnal)
    return None


def check_shape(arrival) -> None:
    """Schema rules for a shaped arrival (raised as ValueError inside pydantic's validation)."""
    given = [k for k in ("rate", "ramp_up", "rate_schedule", "diurnal") if getattr(arrival, k) is not None]
    if "rate_schedule" not in given and "diurnal" not in given:
        return
    if len(given) > 1:
        raise ValueError(f"give one of rate, ramp_up, rate_schedule and diurnal (got {', '.join(given)})")
    if arrival.process not in ("poisson", "gamma", "fixed"):
        raise ValueError(f"a time-varying rate needs process poisson, gamma or fixed, not {arrival.process}")
    if arrival.rate_schedule is not None:
        steps = arrival.rate_schedule
        if not steps or len(steps) > MAX_STEPS:
            raise ValueError(f"rate_schedule must hold 1 to {MAX_STEPS} steps")
        if not any(s.rate > 0 for s in steps):
            raise ValueError("rate_schedule: every step has rate 0; expected at least one positive rate")
        if sum(s.duration_s for s in steps) > MAX_PERIOD_S:
            raise ValueError(f"rate_schedule lasts more than {MAX_PERIOD_S:g} s (30 days)")


def shaped_times(arrival, rng, count: Optional[int], duration: Optional[float]):
    """Arrival times of a shaped process: the first `count`, or all before `duration` (at most count)."""
    import numpy as np

    shape = shape_of(arrival)
    limit = math.inf if duration is None else float(shape.cumulative(duration))
    chunk = count if duration is None else min(int(limit * 1.1) + 16, count or math.inf)
    ops = _operational(arrival, rng, chunk, 0.0)
    while duration is not None and ops[-1] < limit and (count is None or len(ops) < count):
        ops = np.concatenate([ops, _operational(arrival, rng, len(ops), float(ops[-1]))])
    if duration is not None:
        ops = ops[ops < limit][:count]
    elif arrival.rescale and arrival.process != "fixed":
        ops = ops * (count / ops[-1])       # as a constant rate's rescale: the last where Lambda reaches N
    return shape.inverse(ops)


def _operational(arrival, rng, n: int, start: float):
    """n points of the unit-rate renewal process after `start` (operational time)."""
    import numpy as np

    if arrival.process == "fixed":
        return start + np.arange(1, n + 1, dtype=float)
    if arrival.process == "poisson":
        return start + np.cumsum(rng.exponential(1.0, n))
    shape = 1.0 / arrival.cv ** 2
    return start + np.cumsum(rng.gamma(shape, 1.0 / shape, n))
