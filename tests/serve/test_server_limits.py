"""The server's input limits, in process with a stand-in engine: 413, 400 (never 500),
429, parsing off the event loop; and `simrun serve` port checks before the model build."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from engine.serve.app import ServeLimits, build_app  # noqa: E402
from engine.serve.cli import serve_main  # noqa: E402
from engine.serve.engine_loop import Stream  # noqa: E402
from engine.serve.metrics import ServerMetrics  # noqa: E402
from engine.serve.protocol import CompletionParams, Event, ServedModel  # noqa: E402
from sim.errors import UserError  # noqa: E402

SERVED = ServedModel("tiny", "tiny", vocab_size=1024, max_model_len=512, temperature=0.0, eos_token_id=None)


class StubEngine:
    """What build_app needs of EngineLoop; each request gets one token and finishes, unless `hold`."""

    def __init__(self, hold: bool = False):
        self.served, self.drain, self.alive, self.error = SERVED, None, True, None
        self.metrics = ServerMetrics("tiny", 16, 64)
        self.hold, self.submitted, self.loop = hold, [], None

    def start(self, loop):
        self.loop = loop

    def stop(self):
        return {"finished": 0, "aborted": 0, "rejected": 0}

    def abort(self, req_id):
        pass

    def submit(self, params: CompletionParams) -> Stream:
        stream = Stream(self, len(self.submitted))
        self.submitted.append(params)
        stream.queue.put_nowait(Event("accepted"))
        if not self.hold:
            stream.queue.put_nowait(Event("token", 7, "length"))
        return stream


def client(engine=None, **limits) -> TestClient:
    return TestClient(build_app(engine or StubEngine(), "test", ServeLimits(**limits)))


def post(c: TestClient, body) -> "httpx.Response":  # noqa: F821
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return c.post("/v1/completions", content=data, headers={"content-type": "application/json"})


def test_a_good_request_still_completes():
    with client() as c:
        r = post(c, {"prompt": [1, 2, 3], "max_tokens": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [7]


def test_body_over_the_limit_is_413_from_its_length_or_its_stream():
    with client(max_body_bytes=1000) as c:
        r = post(c, {"prompt": [1] * 2000})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413

        def chunks():                      # no Content-Length: counted as it streams
            for _ in range(100):
                yield b" " * 100
        r = c.post("/v1/completions", content=chunks())
        assert r.status_code == 413


MALFORMED = {
    "deep list": b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    "deep in an ignored field": b'{"prompt": [1], "user": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    "deep neutral value": b'{"prompt": [1], "stop": ' + b"[" * 900 + b"]" * 900 + b"}",
    "huge int": b'{"prompt": [' + b"9" * 5000 + b"]}",
    "NaN temperature": b'{"prompt": [1], "temperature": NaN}',
    "Infinity max_tokens": b'{"prompt": [1], "max_tokens": Infinity}',
    "not utf-8": b'{"prompt": [1], "user": "\xff\xfe"}',
    "truncated": b'{"prompt": [1, 2',
    "empty": b"",
    "a list": b"[1, 2, 3]",
    "a string": b'"hello"',
    "prompt of dicts": b'{"prompt": [{"a": 1}]}',
    "prompt too long": json.dumps({"prompt": [1] * 600}).encode(),
    "stream_options a list": b'{"prompt": [1], "stream_options": [1]}',
    "n a dict": b'{"prompt": [1], "n": {"a": 1}}',
    "model a list": b'{"prompt": [1], "model": [1]}',
    "bool max_tokens": b'{"prompt": [1], "max_tokens": true}',
    "null bytes": b'{"prompt": [1], "user": "\\u0000"}' + b"\x00",
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_bodies_are_4xx_never_500(name):
    with client() as c:
        r = post(c, MALFORMED[name])
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
        assert r.json()["error"]["message"] and len(r.text) < 2000


def test_parsing_runs_off_the_event_loop(monkeypatch):
    """While one body is being parsed, /health answers at once."""
    import engine.serve.app as app

    started, release = threading.Event(), threading.Event()
    real = app.parse_body

    def slow_parse(data, served, parse=None):
        started.set()
        release.wait(10)
        return real(data, served, parse)

    monkeypatch.setattr(app, "parse_body", slow_parse)
    with client() as c:
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", post(c, {"prompt": [1], "max_tokens": 1})))
        t.start()
        assert started.wait(10)
        assert c.get("/health").status_code == 200          # the loop is free while parsing
        release.set()
        t.join(10)
        assert result["r"].status_code == 200


def on_app_loop(c, talk):
    """`talk(post)` run on the test client's event loop, where `post()` sends one small completion
    through the app in flight beside the others (the test client's own calls run one at a time)."""
    async def run():
        import httpx

        transport = httpx.ASGITransport(app=c.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as ac:
            return await talk(lambda: ac.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}))
    return c.portal.call(run)


def test_waiting_queue_bound_gives_429():
    engine = StubEngine(hold=True)
    with client(engine, max_waiting=2) as c:
        async def fire(post):
            held = [asyncio.ensure_future(post()) for _ in range(2)]
            while len(engine.submitted) < 2:
                await asyncio.sleep(0.01)
            third = await post()
            for h in held:
                h.cancel()
            return third
        third = on_app_loop(c, fire)
        assert third.status_code == 429 and "max-waiting" in third.json()["error"]["message"]


@pytest.mark.parametrize("port", ["-1", "65536", "http", ""])
def test_serve_refuses_a_bad_port(port, capsys):
    with pytest.raises(SystemExit) as exc:
        serve_main(["--model", "tiny", "--device", "cpu", "--port", port])
    assert exc.value.code == 2 and "port" in capsys.readouterr().err


def test_serve_fails_a_taken_port_before_building_the_model(monkeypatch):
    import engine.serve.cli as cli

    monkeypatch.setattr(cli, "_start_engine", lambda *a: pytest.fail("built the model before binding"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(UserError, match=f"cannot listen on 127.0.0.1:{port}"):
            serve_main(["--model", "tiny", "--device", "cpu", "--port", str(port)])
        assert time.monotonic() - t0 < 30


def test_client_leaving_mid_body_is_not_an_error(caplog):
    app = build_app(StubEngine(), "test")
    messages = iter([{"type": "http.request", "body": b'{"prompt": [1', "more_body": True},
                     {"type": "http.disconnect"}])
    sent = []

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "client": ("t", 1), "server": ("t", 80)}
    with caplog.at_level("DEBUG"):
        asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "WARNING")]
    assert any("disconnected" in r.getMessage() and r.levelname == "DEBUG" for r in caplog.records)


def test_metrics_label_escapes_a_hostile_model_name():
    metrics = ServerMetrics('evil"} 1\nvllm:fake_total{a="b', 16, 64)
    lines = metrics.render().splitlines()
    assert not any(line.startswith("vllm:fake_total") for line in lines)
    assert 'model_name="evil\\"} 1\\nvllm:fake_total{a=\\"b"' in metrics.render()


@pytest.mark.parametrize("options", [{"include_usage": "x"}, {"include_usage": 1}, {"continuous_usage_stats": "no"}])
def test_stream_options_values_must_be_booleans(options):
    """vLLM's StreamOptions (vllm/entrypoints/openai/protocol.py) types include_usage and
    continuous_usage_stats `bool | None`; kvtwin takes JSON true/false only, as for its other
    flags (stricter than pydantic's lax mode, which would read 1 or "yes"): anything else is a
    400 in OpenAI's error shape naming the field."""
    pytest.importorskip("fastapi")
    from engine.serve.protocol import ApiError, ServedModel, parse_body

    served = ServedModel("tiny", "tiny", 1024, 512, 0.0, None)
    body = json.dumps({"prompt": [1, 2], "stream": True, "stream_options": options}).encode()
    with pytest.raises(ApiError) as error:
        parse_body(body, served)
    key = next(iter(options))
    assert error.value.status == 400 and error.value.body()["error"]["param"] == f"stream_options.{key}"
    assert f"stream_options.{key} must be true or false" in error.value.body()["error"]["message"]
    assert parse_body(json.dumps({"prompt": [1], "stream": True, "stream_options": {"include_usage": True}}).encode(),
                      served).include_usage


@pytest.mark.parametrize("flag, value", [("--temperature", "nan"), ("--temperature", "-1"),
                                         ("--temperature", "inf"), ("--shutdown-grace", "nan"),
                                         ("--shutdown-grace", "-5"), ("--shutdown-grace", "inf")])
def test_serve_number_flags_are_finite_and_not_negative(flag, value, capsys):
    from engine.serve.cli import serve_parser

    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--model", "tiny", flag, value])
    assert f"{flag}: {value!r} is not a finite number >= 0" in capsys.readouterr().err


def test_waiting_queue_bound_holds_for_requests_that_arrive_together():
    """Requests read and parsed at the same time (parsing runs on a worker thread) must not all
    pass the --max-waiting check before any of them is counted."""
    engine = StubEngine(hold=True)
    with client(engine, max_waiting=2) as c:
        async def fire(post):
            calls = [asyncio.ensure_future(post()) for _ in range(6)]
            while len(engine.submitted) + sum(call.done() for call in calls) < 6:
                await asyncio.sleep(0.01)
            statuses = [call.result().status_code for call in calls if call.done()]
            for call in calls:
                call.cancel()
            return statuses
        statuses = on_app_loop(c, fire)
    assert len(engine.submitted) == 2 and statuses == [429] * 4


def test_the_shutdown_report_checks_that_every_request_ended():
    from engine.serve.app import shutdown_report

    whole = {"submitted": 4, "finished": 3, "aborted": 0, "rejected": 1, "failed": 0}
    assert shutdown_report(None, whole) == "kvtwin serve: stopped; 3 finished, 0 aborted, 1 rejected in total"
    lost = shutdown_report(None, {**whole, "submitted": 6})
    assert lost.endswith("; 2 of 6 request(s) submitted did not end (a kvtwin bug: please report it)")


@pytest.mark.parametrize("field, value, message", [
    ("return_token_ids", "yes", "return_token_ids must be true or false, got 'yes'"),
    ("return_token_ids", {"a": [1]}, "return_token_ids must be true or false"),
    ("user", 5, "user must be a string, got 5"),
    ("user", ["a"], "user must be a string, got ['a']")])
def test_accepted_fields_are_typed_too(field, value, message):
    with client() as c:
        r = post(c, {"prompt": [1], "max_tokens": 1, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert r.json()["error"]["message"].startswith(message)


def test_a_content_length_of_non_ascii_digits_is_a_400():
    """uvicorn's h11 refuses such a header before the app sees it; another server in front of
    the app (or another ASGI server) may not: '²'.isdigit() holds and int('²') fails."""
    from engine.serve.app import read_body
    from engine.serve.protocol import ApiError

    class Request:
        headers = {"content-length": "\u00b2"}

    with pytest.raises(ApiError, match="Content-Length is not a number") as caught:
        asyncio.run(read_body(Request(), 100))
    assert caught.value.status == 400


# ----------------------------------------------------------------------------- what one client may hold

def test_a_body_that_never_ends_gets_408_within_the_body_timeout():
    """In process: the body's first bytes come, the rest never does; the app answers 408 and
    asks to close the connection (the unread rest must not be read as the next request)."""
    app = build_app(StubEngine(), "test", ServeLimits(body_timeout_s=0.05))
    sent, chunks = [], [{"type": "http.request", "body": b'{"prompt": [1', "more_body": True}]

    async def receive():
        if chunks:
            return chunks.pop()
        await asyncio.Future()           # never: the client keeps the body open

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "client": ("t", 1), "server": ("t", 80)}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"]
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == 408 and "did not arrive within 0.05 s (--body-timeout); 13 bytes came" in error["message"]


class LiveServer:
    """The app under uvicorn, configured as `simrun serve` configures it, on a free port."""

    def __init__(self, engine, limits: ServeLimits):
        import uvicorn

        from engine.serve.cli import bind_socket, uvicorn_config

        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        config = uvicorn_config(build_app(engine, "test", limits), limits, "127.0.0.1", self.port,
                                log_level="critical", shutdown_grace=0)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        wait_for(lambda: self.server.started)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=30)   # 30 s: a hang's bound


def wait_for(condition, what="the server") -> None:
    """Wait (up to a generous 30 s: a bound on a hang, not a timing assertion) until `condition()`."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"{what} never got there"
        time.sleep(0.01)


def request_bytes(body: bytes = b'{"prompt": [1], "max_tokens": 1}', length=None) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (len(body) if length is None else length)) + body


def read_one_response(conn: socket.socket) -> bytes:
    """One whole response with a Content-Length (its head and body may arrive in several pieces)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536) or pytest.fail(f"closed after {data!r}")
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.lower().split(b"\r\n")
                      if line.startswith(b"content-length:")))
    while len(body) < length:
        body += conn.recv(65536) or pytest.fail(f"closed after {data + body!r}")
    assert len(body) == length, "more than one response arrived"
    return head + b"\r\n\r\n" + body


def read_until_closed(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def test_connections_past_limit_concurrency_get_503():
    """uvicorn's limit_concurrency (h11_impl.py: 503 when `len(connections) >= limit` or as many
    requests run): at 2, one connection holding a request leaves room for no other."""
    engine = StubEngine(hold=True)
    with LiveServer(engine, ServeLimits(limit_concurrency=2)) as live:
        held = live.connect()
        held.sendall(request_bytes())
        wait_for(lambda: len(engine.submitted) == 1, "the first request")
        second = live.connect()
        second.sendall(request_bytes())
        answer = read_until_closed(second)
        assert answer.startswith(b"HTTP/1.1 503") and answer.endswith(b"Service Unavailable")
        assert len(engine.submitted) == 1
        held.close()
        second.close()


def test_an_idle_connection_is_closed_after_the_keep_alive_timeout():
    with LiveServer(StubEngine(), ServeLimits(keep_alive_s=0.1)) as live:
        conn = live.connect()
        conn.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
        answer = read_until_closed(conn)          # returns only once the server closes it
        conn.close()
    assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1") == 1


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout():
    """uvicorn arms no timer before a connection's first request: without kvtwin's protocol this
    connection would stay open (and hold a --limit-concurrency slot) until the client leaves."""
    with LiveServer(StubEngine(), ServeLimits(header_timeout_s=0.1)) as live:
        conn = live.connect()
        assert read_until_closed(conn) == b""          # returns only once the server closes it
        conn.close()


def test_headers_trickling_in_are_cut_off_at_the_header_timeout():
    """Bytes keep arriving, each one would reset uvicorn's keep-alive timer; the head's limit counts
    from its first byte, so the connection closes with no request reaching the engine."""
    engine = StubEngine()
    with LiveServer(engine, ServeLimits(header_timeout_s=0.2)) as live:
        conn = live.connect()
        closed = False
        for byte in request_bytes()[:40]:
            try:
                conn.sendall(bytes([byte]))
            except OSError:                             # the server has closed it
                closed = True
                break
            time.sleep(0.02)                            # 40 bytes over ~0.8 s, past the 0.2 s limit
        if not closed:
            assert read_until_closed(conn) == b""
        conn.close()
    assert engine.submitted == []


def test_the_header_timeout_leaves_answered_and_kept_alive_requests_alone():
    """A request whose head arrives in time is answered even when it outlives the head's limit, and
    a kept-alive connection's next request gets its own limit from its first byte."""
    with LiveServer(StubEngine(), ServeLimits(header_timeout_s=0.3, keep_alive_s=5)) as live:
        conn = live.connect()
        conn.sendall(request_bytes())
        first = read_one_response(conn)
        time.sleep(0.5)                                 # idle past the head's limit: keep-alive's turn
        conn.sendall(request_bytes())
        second = read_one_response(conn)
        conn.sendall(b"GET /health HTTP/1.1\r\n")       # a head that never ends
        rest = read_until_closed(conn)
        conn.close()
    assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 200")
    assert rest == b""


def test_a_slow_body_over_the_wire_gets_408_and_the_connection_closes():
    with LiveServer(StubEngine(), ServeLimits(body_timeout_s=0.1)) as live:
        conn = live.connect()
        conn.sendall(request_bytes(b'{"prompt": [1', length=1000))     # 13 of 1000 bytes, then nothing
        answer = read_until_closed(conn)
        conn.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"connection: close" in answer.lower()
    assert b"did not arrive within 0.1 s" in answer


@pytest.mark.parametrize("flag", ["--body-timeout", "--timeout-keep-alive", "--header-timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_serve_timeouts_are_finite_and_positive(flag, value, capsys):
    from engine.serve.cli import serve_parser

    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--model", "tiny", flag, value])
    assert f"{flag}: {value!r} is not a finite number > 0" in capsys.readouterr().err
    args = serve_parser().parse_args(["--model", "tiny", flag, "2.5", "--limit-concurrency", "8"])
    assert (getattr(args, flag[2:].replace("-", "_")), args.limit_concurrency) == (2.5, 8)
