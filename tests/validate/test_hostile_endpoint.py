"""`simrun bench` against a hostile or broken endpoint: every answer it can give ends each
request failed with a reason (or the bench with a clean error), never a traceback, a hang or a
terminal driven by the server's text."""
from __future__ import annotations

import asyncio
import json

import pytest

from sim.scenario import validate_scenario
from validate.bench import run_bench
from validate.endpoint_client import BenchError

from test_bench import fake_endpoint, small_raw   # noqa: E402 (tests/ is on sys.path under pytest)


def _chunk(body) -> str:
    return f"data: {json.dumps(body)}\n\n"


GOOD = _chunk({"choices": [{"index": 0, "text": "a"}]})

# max_tokens -> what the stream carries before its usage and [DONE] (4 and 8, the smoke request, are well formed)
HOSTILE_EVENTS = {
    10: [_chunk({"choices": "abc"})],
    11: [_chunk({"choices": [{"token_ids": 5}]})],
    12: [GOOD, _chunk({"choices": [], "usage": [1]})],
    13: [GOOD] * 13 + [_chunk({"choices": [], "usage": {"completion_tokens": 13,
                                                       "prompt_tokens_details": {"cached_tokens": "lots"}}})],
    14: ['data: {"choices": [{"x": ' + "9" * 5000 + '}]}\n\n'],
    15: ['data: {"choices": ' + "[" * 100000 + "]" * 100000 + '}\n\n'],
    16: [_chunk({"choices": [5]})],
    17: [GOOD] * 17 + [_chunk({"choices": [], "usage": {"completion_tokens": True}})],
    18: [GOOD] * 18 + [_chunk({"choices": [], "usage": {"completion_tokens": 18,
                                                       "prompt_tokens_details": {"cached_tokens": -3}}})],
    19: [GOOD] * 19 + [_chunk({"choices": [], "usage": {"completion_tokens": 19,
                                                       "prompt_tokens_details": {"cached_tokens": 10**6}}})],
    24: [_chunk({"error": {"message": "\x1b[2J\x1b]0;pwned\x07 boom\n"}})],
}
EXPECTED = {
    10: "malformed stream: choices is 'abc', expected a list of choice objects",
    11: "malformed stream: choices[0].token_ids is 5, expected a list of token ids",
    12: "malformed stream: usage is [1], expected an object",
    13: "malformed stream: usage.prompt_tokens_details.cached_tokens is 'lots', expected a whole number >= 0",
    14: "malformed stream: event is not JSON (Exceeds the limit (4300 digits)",
    15: "malformed stream: event is not JSON (it nests too deeply)",
    16: "malformed stream: choices[0] is 5, expected an object",
    17: "malformed stream: usage.completion_tokens is True, expected a whole number >= 0",
    18: "malformed stream: usage.prompt_tokens_details.cached_tokens is -3, expected a whole number >= 0",
    19: "malformed stream: usage.prompt_tokens_details.cached_tokens is 1000000, more than the prompt's 16",
    24: "server error: \\x1b[2J\\x1b]0;pwned\\x07 boom\\n",    # escaped: it must not drive the terminal
}


async def _pings():                 # 20: keep-alive comments, never a token
    while True:
        yield ": ping\n\n" * 64
        await asyncio.sleep(0)


async def _endless_line():          # 21: one line that never ends
    yield 'data: {"choices": [{"text": "'
    while True:
        yield "a" * 65536
        await asyncio.sleep(0)


async def _endless_error():         # 22: HTTP 500 whose body never ends
    while True:
        yield "x" * 65536
        await asyncio.sleep(0)


async def _trickle():               # 23: a token chunk now and then, well within the per-chunk timeout
    while True:
        yield ": still here\n\n"
        await asyncio.sleep(0.3)


ENDLESS = {20: _pings, 21: _endless_line, 22: _endless_error, 23: _trickle}


def hostile_app(models_body: bytes = b'{"data": [{"id": "fake"}]}'):
    from starlette.applications import Starlette
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    async def models(_request):
        return Response(models_body, media_type="application/json")

    async def completions(request):
        n = (await request.json())["max_tokens"]
        if n in ENDLESS:
            return StreamingResponse(ENDLESS[n](), status_code=500 if n == 22 else 200,
                                     media_type="text/event-stream")

        async def events():
            for line in HOSTILE_EVENTS.get(n, [GOOD] * n):
                yield line
            if n not in HOSTILE_EVENTS:
                yield _chunk({"choices": [], "usage": {"completion_tokens": n}})
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])


def bench_against(app, outputs: list[int], scrape_s: float = 0.5):
    """`simrun bench` of requests with these output lengths against `app` served on a free port
    (10 s request timeout, metrics scraped every `scrape_s`), the endpoint stopped after."""
    url, stop = fake_endpoint(app)
    try:
        return run_bench(validate_scenario(small_raw(outputs)), url, None, 10.0, scrape_s)
    finally:
        stop()


def test_malformed_events_fail_their_request_with_a_reason():
    outputs = [4, *HOSTILE_EVENTS]
    measured = bench_against(hostile_app(), outputs)
    frame = measured.requests.set_index("id")
    assert frame["status"].tolist() == ["finished"] + ["failed"] * len(HOSTILE_EVENTS)
    for i, n in enumerate(HOSTILE_EVENTS, start=1):
        assert frame["reject_reason"][i].startswith(EXPECTED[n]), (n, frame["reject_reason"][i])
    assert measured.summary["requests_failed"] == len(HOSTILE_EVENTS)


@pytest.mark.parametrize("body, expected", [
    (b"[1]", r"/v1/models answered \[1\], expected an object with a `data` list of models"),
    (b"null", r"/v1/models answered None, expected an object"),
    (b'{"data": 5}', r"/v1/models: data is 5, expected a list of models"),
    (b'{"data": [5]}', r"/v1/models: data\[0\] is 5, expected an object with a string `id`"),
    (b'{"data": [{"root": "x"}]}', r"/v1/models: data\[0\] is \{'root': 'x'\}, expected an object with a string `id`"),
    (b'{"data": [{"id": {"a": 1}}]}', r"data\[0\] is \{'id': \{'a': 1\}\}, expected an object with a string `id`"),
    (b'{"data": [{"id": "fake", "max_model_len": "NaN"}]}', r"data\[0\].max_model_len is 'NaN', expected a whole number"),
    (b'{"data": [{"id": "fake", "root": 7}]}', r"data\[0\].root is 7, expected a string"),
])
def test_a_broken_model_list_is_a_clean_error(body, expected):
    with pytest.raises(BenchError, match=expected):
        bench_against(hostile_app(body), [4])


def test_endless_and_huge_streams_are_cut_with_a_reason(monkeypatch):
    """A stream is bounded in lines, line length, error-body size and total time. The total
    (6 hours) is vLLM bench's own: vllm/benchmarks/lib/endpoint_request_func.py, AIOHTTP_TIMEOUT
    = ClientTimeout(total=6 * 60 * 60) (v0.10); shortened here."""
    from validate import endpoint_client

    monkeypatch.setattr(endpoint_client, "REQUEST_DEADLINE_S", 2.0)
    measured = bench_against(hostile_app(), [4, 20, 21, 22, 23])
    reasons = measured.requests.set_index("id")["reject_reason"]
    assert measured.requests["status"].tolist() == ["finished"] + ["failed"] * 4
    assert reasons[1].startswith("malformed stream: more than 1104 lines for 20 tokens asked")
    assert reasons[2] == "malformed stream: a line of more than 1048576 characters"
    assert reasons[3].startswith("HTTP 500: " + "x" * 100) and reasons[3].endswith("...")
    assert reasons[4] == "no [DONE] within 2.0 s (a request's time limit, as vLLM bench's)"


def _with_metrics(app, metrics):
    """`app` with a /metrics route answering `metrics()` (a string or an async generator)."""
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    async def route(_request):
        body = metrics()
        if isinstance(body, str):
            return Response(body, media_type="text/plain")
        return StreamingResponse(body, media_type="text/plain")
    app.router.routes.append(Route("/metrics", route))
    return app


def test_hostile_metrics_samples_are_refused_and_noted():
    scrapes = iter(range(10**6))

    def metrics():        # every other scrape says infinity requests run; the pool size is no number
        bad = next(scrapes) % 2
        return (f"vllm:num_requests_running {'+Inf' if bad else '1'}\nvllm:kv_cache_usage_perc 0.5\n"
                'vllm:cache_config_info{num_gpu_blocks="\u00b2"} 1\n')
    measured = bench_against(_with_metrics(hostile_app(), metrics), [4, 4], scrape_s=0.05)
    assert (measured.requests["status"] == "finished").all()
    assert measured.kv_blocks_total == 0                              # '²' is no block count
    assert (measured.timeline["running"] == 1).all()                  # the +Inf samples are not in it
    assert any(n.startswith("the endpoint's /metrics gave ") and "running = inf" in n
               for n in measured.manifest["notes"]), measured.manifest["notes"]


def test_an_endless_metrics_page_is_not_read_forever():
    async def endless():
        yield "vllm:num_requests_running 1\n"
        while True:
            yield "# " + "x" * 65534 + "\n"
            await asyncio.sleep(0)
    measured = bench_against(_with_metrics(hostile_app(), endless), [4])
    assert (measured.requests["status"] == "finished").all()
    assert measured.timeline is None
    assert any("/metrics answered more than 33554432 bytes" in n for n in measured.manifest["notes"]), \
        measured.manifest["notes"]


@pytest.mark.parametrize("flag, value", [("--request-timeout", "nan"), ("--request-timeout", "-1"),
                                         ("--request-timeout", "0"), ("--scrape-interval", "nan"),
                                         ("--scrape-interval", "0"), ("--scrape-interval", "inf")])
def test_bench_time_flags_are_positive_and_finite(flag, value, capsys):
    from sim.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "scenarios/serve_smoke.yaml", "--endpoint", "127.0.0.1:9", flag, value])
    assert f"{flag}: {value!r}: expected a positive number of seconds" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--endpoint", "http://[::1"], "--endpoint 'http://[::1': not a URL"),
    (["--endpoint", "http://x:abc"], "--endpoint 'http://x:abc': not a URL"),
    (["--endpoint", "127.0.0.1:9", "--header", "X-A: caf\udce9"], "--header 'X-A: caf\\udce9': "
                                                                 "expected ASCII text")])
def test_a_malformed_endpoint_or_header_is_a_clean_error(argv, message, capsys):
    from sim.cli import main

    assert main(["bench", "scenarios/serve_smoke.yaml", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_an_endless_prefix_cache_reset_answer_is_cut():
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    app = hostile_app()

    async def reset(_request):
        return StreamingResponse(_endless_error(), status_code=500)
    app.router.routes.append(Route("/reset_prefix_cache", reset, methods=["POST"]))
    measured = bench_against(app, [4])
    assert measured.manifest["prefix_cache"]["reset"].startswith("refused (HTTP 500: xxxxxxxx")


def _odd_charset_app(charset: str):
    """Answers well, except max_tokens 5: a stream whose Content-Type names a codec that is not a
    text encoding (httpx looks the name up, finds it, and its decoder fails on the bytes)."""
    from starlette.applications import Starlette
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    async def models(_request):
        return Response(b'{"data": [{"id": "fake"}]}', media_type="application/json")

    async def completions(request):
        n = (await request.json())["max_tokens"]

        async def events():
            for line in [GOOD] * n + [_chunk({"choices": [], "usage": {"completion_tokens": n}}), "data: [DONE]\n\n"]:
                yield line
        kind = f"text/event-stream; charset={charset}" if n == 5 else "text/event-stream"
        return StreamingResponse(events(), headers={"content-type": kind})

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])


@pytest.mark.parametrize("charset", ["rot13", "base64"])
def test_an_unexpected_client_error_fails_its_request_not_the_run(charset):
    """An answer the client's checks do not foresee (here a charset that breaks httpx's text
    decoder with a TypeError or ValueError, no stream or HTTP error) ends that request failed
    with the reason; the other requests go on, and the manifest counts such failures."""
    measured = bench_against(_odd_charset_app(charset), [4, 5, 6])
    frame = measured.requests.set_index("id")
    assert frame["status"].tolist() == ["finished", "failed", "finished"]
    assert frame["reject_reason"][1].startswith("client error: ")
    assert measured.summary["requests_failed"] == 1 and measured.summary["requests_finished"] == 2
    assert any(n.startswith("1 request(s) failed on a client error") for n in measured.manifest["notes"])


def test_every_request_of_the_run_ends_and_the_run_checks_it(monkeypatch):
    """A request the load generator loses (here: its conversation is never started) is not left
    out: the run's accounting ends it failed with a reason and notes it."""
    from validate.bench import Bench

    conversation = Bench._conversation

    async def lose_request_1(self, trip):
        if trip.request.id != 1:
            await conversation(self, trip)
    monkeypatch.setattr(Bench, "_conversation", lose_request_1)
    measured = bench_against(hostile_app(), [4, 5, 6])
    frame = measured.requests.set_index("id")
    assert frame["status"].tolist() == ["finished", "failed", "finished"]
    assert frame["reject_reason"][1] == "never ended: the load generator lost it (a kvtwin bug: please report it)"
    assert any(n.startswith("1 request(s) never ended") for n in measured.manifest["notes"])
