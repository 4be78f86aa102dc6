"""`simrun serve`'s engine thread in process, no HTTP (engine/serve/engine_loop.py): EOS and the
scheduler's rejections relayed, a failing step failing only its own requests, repeated failures
taking the engine down with nothing left hanging."""
from __future__ import annotations

import asyncio

import pytest

from engine.replay import new_scheduler
from engine.runner import ModelRunner
from engine.serve.engine_loop import EngineLoop
from engine.serve.protocol import ApiError, CompletionParams, Event, ServedModel
from sim.scenario import load_scenario
from support import SMOKE as SCENARIO, SMOKE_MAX_MODEL_LEN as MAX_MODEL_LEN, TINY_VOCAB as VOCAB


def test_engine_loop_stops_at_eos_and_relays_scheduler_rejections():
    """In process: EOS ends a request unless ignore_eos; a request the scheduler refuses is
    answered with the scheduler's reason (the HTTP layer turns that into a 400)."""
    scenario = load_scenario(SCENARIO, ["engine.max_model_len=64"])   # the HTTP side believes 512
    runner = ModelRunner.from_scenario(scenario, "cpu")
    prompt = [1, 2, 3, 4]

    async def run(ignore_eos: bool, eos: int | None, prompt=prompt, max_tokens=5) -> list:
        served = ServedModel("m", "m", VOCAB, MAX_MODEL_LEN, 0.0, eos)
        engine = EngineLoop(new_scheduler(scenario, runner.num_blocks), runner, served)
        engine.start(asyncio.get_running_loop())
        stream = engine.submit(CompletionParams(prompt, max_tokens, ignore_eos, True, False))
        events = [await stream.next()]
        while not stream.ended:
            events.append(await stream.next())
        await asyncio.to_thread(engine.stop)
        return events

    greedy = [e.token for e in asyncio.run(run(True, None))[1:]]
    eos = greedy[-1]
    events = asyncio.run(run(False, eos))
    assert [e.token for e in events[1:]] == greedy[:greedy.index(eos) + 1] and events[-1].finish_reason == "stop"
    events = asyncio.run(run(True, eos))
    assert len(events) == 6 and events[-1].finish_reason == "length"
    refused = asyncio.run(run(True, None, prompt=list(range(100)), max_tokens=10))
    assert refused == [Event("rejected", message="prompt of 100 tokens leaves no room for output within "
                                                  "max_model_len 64")]


class FlakyRunner:
    """The real runner, with `failures` of its steps raising first (an injected engine error)."""

    def __init__(self, runner, failures: int):
        self.runner, self.failures = runner, failures
        self.num_blocks = runner.num_blocks

    def execute(self, batch):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("injected: CUDA error: an illegal memory access was encountered")
        return self.runner.execute(batch)


def run_engine(failures: int, requests: int = 3, timeout: float = 60):
    """Submit `requests` (two at once, then the rest after they end) to an engine whose first
    `failures` steps raise; every stream's events, the blocks still held, the engine."""
    scenario = load_scenario(SCENARIO, ["engine.max_model_len=64"])
    runner = ModelRunner.from_scenario(scenario, "cpu")
    served = ServedModel("m", "m", VOCAB, 64, 0.0, None)

    async def drain(stream):
        events = [await stream.next()]
        while not stream.ended:
            events.append(await stream.next())
        return events

    async def main():
        engine = EngineLoop(new_scheduler(scenario, runner.num_blocks), FlakyRunner(runner, failures), served)
        engine.start(asyncio.get_running_loop())
        params = CompletionParams([1, 2, 3, 4], 5, True, True, False)
        first = [engine.submit(params), engine.submit(params)]
        results = await asyncio.wait_for(asyncio.gather(*map(drain, first)), timeout)
        for _ in range(requests - 2):
            results.append(await asyncio.wait_for(drain(engine.submit(params)), timeout))
        used = engine.scheduler.kv.num_used_blocks
        await asyncio.to_thread(engine.stop)
        return results, used, engine

    return asyncio.run(main())


def test_a_failing_step_fails_its_requests_frees_their_blocks_and_the_engine_goes_on():
    results, used, engine = run_engine(failures=1)
    assert [r[-1].kind for r in results[:2]] == ["error", "error"]          # the failed step's batch
    assert "illegal memory access" in results[0][-1].message
    assert results[2][-1].kind == "token" and results[2][-1].finish_reason == "length"
    assert used == 0 and engine.alive is False and engine.error is None    # stopped cleanly, not down
    assert engine.counts["failed"] == 2 and engine.counts["finished"] == 1


def test_repeated_failures_take_the_engine_down_and_nothing_hangs():
    results, used, engine = run_engine(failures=10, requests=5, timeout=30)   # down after the 3rd step
    assert all(r[-1].kind == "error" for r in results)
    assert "engine is down" in results[-1][-1].message                    # answered at once afterwards
    assert engine.error is not None and not engine.alive and used == 0


def test_a_down_engine_answers_a_prefix_cache_reset_with_503():
    scenario = load_scenario(SCENARIO, ["engine.max_model_len=64"])
    runner = ModelRunner.from_scenario(scenario, "cpu")
    served = ServedModel("m", "m", VOCAB, 64, 0.0, None)

    async def main():
        engine = EngineLoop(new_scheduler(scenario, runner.num_blocks), FlakyRunner(runner, 10), served)
        engine.start(asyncio.get_running_loop())
        for _ in range(3):                      # three failing steps: down
            stream = engine.submit(CompletionParams([1, 2, 3], 2, True, True, False))
            while not stream.ended:
                await asyncio.wait_for(stream.next(), 30)
        with pytest.raises(ApiError, match="engine is down") as e:
            await asyncio.wait_for(engine.reset_prefix_cache(), 10)
        await asyncio.to_thread(engine.stop)
        return e.value.status

    assert asyncio.run(main()) == 503


class FailingAdmission:
    """A scheduler whose add() raises (an injected bug); everything else is the real one's."""

    def __init__(self, scheduler):
        self.real = scheduler

    def add(self, req):
        raise RuntimeError("injected: the scheduler failed while admitting")

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_request_whose_admission_fails_is_answered_and_every_request_is_accounted():
    """An error while the scheduler admits a request (it takes the engine down) still answers
    that request, and the counts at stop add up to the requests submitted."""
    scenario = load_scenario(SCENARIO, ["engine.max_model_len=64"])
    runner = ModelRunner.from_scenario(scenario, "cpu")
    served = ServedModel("m", "m", VOCAB, 64, 0.0, None)

    async def main():
        engine = EngineLoop(new_scheduler(scenario, runner.num_blocks), runner, served)
        params = CompletionParams([1, 2, 3], 2, True, True, False)
        engine.start(asyncio.get_running_loop())
        first = engine.submit(params)
        while not first.ended:
            await asyncio.wait_for(first.next(), 30)

        engine.scheduler = FailingAdmission(engine.scheduler)
        second = engine.submit(params)
        event = await asyncio.wait_for(second.next(), 30)
        later = await asyncio.wait_for(engine.submit(params).next(), 30)
        counts = await asyncio.to_thread(engine.stop)
        return event, later, counts

    event, later, counts = asyncio.run(main())
    assert event.kind == "error" and "failed while admitting" in event.message
    assert later.kind == "error" and "engine is down" in later.message
    assert counts == {"submitted": 3, "finished": 1, "aborted": 0, "rejected": 0, "failed": 2}
