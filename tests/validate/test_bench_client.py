"""`simrun bench`'s client: closed loop, warm prefix cache detection, headers."""
from __future__ import annotations

import asyncio
import json

import pytest

from sim.scenario import validate_scenario
from validate.bench import run_bench
from validate.bench_cli import request_headers

from test_bench import fake_endpoint   # noqa: E402 (tests/ is on sys.path under pytest)


def caching_app(log: dict):
    """Streams max_tokens tokens, 20 ms apart; reports cached_tokens for a prompt it saw before
    (a server whose cache survives between runs); counts requests in flight; no reset endpoint."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    seen: set = set()

    async def models(request):
        log["headers"] = dict(request.headers)
        return JSONResponse({"data": [{"id": "fake"}]})

    async def completions(request):
        body = await request.json()
        prompt = tuple(body["prompt"])
        cached = len(prompt) // 16 * 16 if prompt in seen else 0
        seen.add(prompt)

        async def events():
            log["in_flight"] = log.get("in_flight", 0) + 1
            log["peak"] = max(log.get("peak", 0), log["in_flight"])
            try:
                for t in range(body["max_tokens"]):
                    await asyncio.sleep(0.02)
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': str(t)}]})}\n\n"
                usage = {"completion_tokens": body["max_tokens"], "prompt_tokens_details": {"cached_tokens": cached}}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                log["in_flight"] -= 1
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])


def _scenario(**workload):
    return validate_scenario({"model": "tiny", "device": "cpu", "engine": {"num_blocks": 64, "max_model_len": 256},
                              "workload": {"requests": [{"prompt_len": 16, "output_len": 3, "arrival_s": 0.0}
                                                        for _ in range(6)], **workload}})


def test_a_warm_cache_from_an_earlier_run_is_detected_and_noted():
    log: dict = {}
    url, stop = fake_endpoint(caching_app(log))
    try:
        first = run_bench(_scenario(), url, None, 10.0, 0.5)
        second = run_bench(_scenario(), url, None, 10.0, 0.5)
    finally:
        stop()
    assert first.manifest["prefix_cache"]["warm_before"] is False
    cache = second.manifest["prefix_cache"]
    assert cache["warm_before"] is True and cache["probe_hit_tokens"] == 240 and cache["reset"].startswith("not offered")
    assert any("prefix cache was warm from an earlier run" in n for n in second.manifest["notes"])


def test_closed_loop_caps_requests_in_flight_and_headers_are_sent():
    log: dict = {}
    url, stop = fake_endpoint(caching_app(log))
    try:
        measured = run_bench(_scenario(max_concurrency=2), url, None, 10.0, 0.5,
                             headers=request_headers(["X-Team: kv"], "sk-test"))
    finally:
        stop()
    assert (measured.requests["status"] == "finished").all()
    assert log["peak"] == 2                                   # six due at t=0, two at a time
    sent = measured.requests["arrival_s"].sort_values().to_numpy()
    assert sent[2] - sent[0] > 0.05                           # the third waited for a finish
    assert log["headers"]["x-team"] == "kv" and log["headers"]["authorization"] == "Bearer sk-test"
    assert measured.manifest["headers"] == ["Authorization", "X-Team"]      # names, never the key
    assert measured.manifest["load"]["max_concurrency"] == 2


def test_bad_header_is_refused():
    from sim.errors import UserError

    with pytest.raises(UserError, match="expected 'Name: value'"):
        request_headers(["no colon"], None)
