"""`simrun serve` on CPU with the tiny model, and `simrun bench` against it: the CI check.

The server runs in a subprocess on 127.0.0.1 (a free port), configured from the same
scenario the bench replays, so the prediction and the endpoint share one engine setup.
"""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pandas as pd
import pytest

from engine.replay import new_scheduler
from engine.runner import ModelRunner
from engine.serve.engine_loop import EngineLoop
from engine.serve.protocol import ServedModel
from sim.cli import main
from sim.scenario import load_scenario
from sim.workload import build_workload
from support import SMOKE as SCENARIO, SMOKE_MAX_MODEL_LEN as MAX_MODEL_LEN, TINY_VOCAB as VOCAB, TOKENIZER

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}     # a tiny model steps fastest on one thread
    proc = subprocess.Popen([sys.executable, "-m", "sim.cli", "serve", "--scenario", str(SCENARIO),
                             "--device", "cpu", "--port", str(port), *extra],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become healthy within 60 s")


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err


@pytest.fixture(scope="module")
def server():
    proc, url = start_server()
    try:
        yield url
    finally:
        code, err = stop(proc)
    assert code == 0 and "shut down on SIGTERM: 0 request(s) in flight" in err, err


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def complete(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


# ----------------------------------------------------------------------------- bench

def test_bench_against_live_server_measures_every_request(server, tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", str(SCENARIO), "--endpoint", server, "--out", str(out), "--scrape-interval", "0.1"]) == 0
    requests = pd.read_csv(out / "measured" / "requests.csv")
    scripted = {r.id: r for r in build_workload(load_scenario(SCENARIO)).requests}
    assert len(requests) == len(scripted) and (requests["status"] == "finished").all()
    assert all(row.output_tokens == scripted[row.id].output_len for row in requests.itertuples())
    assert (requests["ttft_s"] > 0).all() and (requests["e2e_s"] > requests["ttft_s"]).all()
    summary = json.loads((out / "measured" / "summary.json").read_text())
    assert summary["partial"] is False and summary["requests_measured"] == 18
    for metric in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        assert summary[metric]["p50"] > 0, metric
    assert summary["kv_blocks_total"] == 255                  # from vllm:cache_config_info
    manifest = json.loads((out / "measured" / "manifest.json").read_text())
    assert manifest["smoke"]["tokens"] == 8 and manifest["server"]["model"] == manifest["server"]["root"]
    assert manifest["sampling"]["ignore_eos"] is True and manifest["notes"] == []
    timeline = pd.read_csv(out / "measured" / "metrics_timeline.csv")
    assert len(timeline) >= 3 and {"kv_usage", "running", "waiting"} <= set(timeline.columns)
    table = pd.read_csv(out / "comparison.csv").set_index("metric")
    assert table.loc["KV pool blocks", "relative_error"] == 0
    # Same workload, same policy code: the prefix cache hits the same tokens on both sides (up to
    # an arrival that lands on the other side of a step boundary in the prediction).
    assert table.loc["prefix hit rate", "measured"] == pytest.approx(table.loc["prefix hit rate", "predicted"],
                                                                     abs=0.05)
    assert "Predicted vs measured" in (out / "report.html").read_text()
    assert "predicted vs measured" in capsys.readouterr().out


def test_bench_endpoint_down_is_a_clear_error(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", str(SCENARIO), "--endpoint", url, "--out", str(tmp_path / "o")]) == 2
    assert f"cannot reach {url}" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- the API

def test_streamed_and_whole_completions_agree(server):
    prompt = list(range(40))
    whole = complete(server, prompt=prompt, max_tokens=6).json()
    choice = whole["choices"][0]
    assert len(choice["token_ids"]) == 6 and choice["finish_reason"] == "length"
    assert choice["text"] == " ".join(map(str, choice["token_ids"]))
    assert whole["usage"]["prompt_tokens"] == 40 and whole["usage"]["completion_tokens"] == 6
    with httpx.stream("POST", f"{server}/v1/completions", timeout=30,
                      json={"prompt": prompt, "max_tokens": 6, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]]
    assert tokens == choice["token_ids"]             # greedy: the same answer either way
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    # the second request found the first's prompt blocks in the prefix cache
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


@pytest.mark.parametrize("body, status, message", [
    ({"prompt": "Hello", "max_tokens": 4}, 400, "prompt as text needs a tokenizer"),
    ({"prompt": [1, 2, VOCAB], "max_tokens": 4}, 400, f"prompt[2] = {VOCAB} is outside the vocabulary"),
    ({"prompt": [1, -1], "max_tokens": 4}, 400, "outside the vocabulary"),
    ({"prompt": [1, "2"], "max_tokens": 4}, 400, "token ids must be integers"),
    ({"prompt": [], "max_tokens": 4}, 400, "non-empty list"),
    ({"prompt": [[1, 2], [3]], "max_tokens": 4}, 400, "batched prompts"),
    ({"prompt": list(range(500)), "max_tokens": 13}, 400,
     f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested 513 tokens"),
    ({"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens must be at least 1"),
    ({"prompt": [1, 2], "max_tokens": "8"}, 400, "max_tokens must be an integer"),
    ({"prompt": [1, 2], "stream": "yes"}, 400, "stream must be true or false"),
    ({"prompt": [1, 2], "n": 2}, 400, "n=2 is not supported"),
    ({"prompt": [1, 2], "temperature": 0.7}, 400, "samples every request at temperature 0.0"),
    ({"prompt": [1, 2], "top_p": 0.5}, 400, "top_p=0.5 is not supported"),
    ({"prompt": [1, 2], "frobnicate": 1}, 400, "unsupported field(s): frobnicate"),
    ({"prompt": [1, 2], "model": "gpt-4"}, 404, "The model `gpt-4` does not exist."),
])
def test_bad_requests_are_refused_with_a_reason(server, body, status, message):
    reply = complete(server, **body)
    assert reply.status_code == status
    assert message in reply.json()["error"]["message"]
    assert reply.json()["error"]["code"] == status


def test_server_keeps_serving_after_bad_requests(server):
    assert httpx.post(f"{server}/v1/completions", content=b"{not json", timeout=10).status_code == 400
    assert httpx.post(f"{server}/v1/completions", json=[1, 2], timeout=10).status_code == 400
    # vLLM's benchmark client sends these neutral sampling fields: accepted
    reply = complete(server, prompt=[5, 6, 7], max_tokens=3, repetition_penalty=1.0, logprobs=None,
                     temperature=0.0, best_of=1, ignore_eos=True)
    assert reply.status_code == 200 and len(reply.json()["choices"][0]["token_ids"]) == 3
    assert httpx.get(f"{server}/health").status_code == 200


def test_models_version_and_metrics_names(server):
    card = httpx.get(f"{server}/v1/models").json()["data"][0]
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{server}/version").json()["server"] == "kvtwin"
    text = httpx.get(f"{server}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:request_time_per_output_token_seconds_count",
                 "vllm:inter_token_latency_seconds_sum", "vllm:e2e_request_latency_seconds_count"):
        assert name in text, name


class GatedRunner:
    """The real runner, stepping only when the test lets it: `allow(n)` lets n more steps run,
    `open()` every later one, `close()` gates again. The test, not the CPU's speed, decides how
    far a request has got when its client leaves or the grace period ends."""

    def __init__(self, runner):
        self.runner, self.num_blocks = runner, runner.num_blocks
        self.permits, self.opened = threading.Semaphore(0), threading.Event()
        self.reached = 0                # steps that came to the gate since the last close()

    def allow(self, steps: int = 1) -> None:
        for _ in range(steps):
            self.permits.release()

    def open(self) -> None:
        self.opened.set()
        self.permits.release()          # the step waiting at the gate, if any

    def close(self) -> None:
        self.opened.clear()
        self.permits, self.reached = threading.Semaphore(0), 0

    def execute(self, batch):
        if not self.opened.is_set():
            self.reached += 1
            if not self.permits.acquire(timeout=30):
                raise RuntimeError("the test never let this step run")
        return self.runner.execute(batch)


class AsgiCall:
    """One HTTP request sent straight into the app (no socket): the test says when the client leaves."""

    def __init__(self, app, body: dict):
        self.app, self.body = app, json.dumps(body).encode()
        self.left, self.sent = asyncio.Event(), asyncio.Queue()
        self.task = None

    def start(self) -> "AsgiCall":
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "root_path": "", "query_string": b"", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(self.body)).encode())]}
        pending = [{"type": "http.request", "body": self.body, "more_body": False}]

        async def receive():
            if pending:
                return pending.pop()
            await self.left.wait()
            return {"type": "http.disconnect"}

        self.task = asyncio.ensure_future(self.app(scope, receive, self.sent.put))
        return self

    async def body_until(self, text: bytes) -> bytes:
        """What the app has sent, read until `text` appears in it."""
        received = b""
        while text not in received:
            message = await asyncio.wait_for(self.sent.get(), 30)
            received += message.get("body", b"")
        return received


def gated_engine():
    from engine.serve.app import build_app

    scenario = load_scenario(SCENARIO, ["workload.shared_prefix=null"])
    runner = GatedRunner(ModelRunner.from_scenario(scenario, "cpu"))
    served = ServedModel("m", "m", VOCAB, MAX_MODEL_LEN, 0.0, None)
    engine = EngineLoop(new_scheduler(scenario, runner.num_blocks), runner, served)
    return engine, runner, build_app(engine, "test")


async def until(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


def test_client_disconnect_frees_its_blocks():
    """A streaming client that leaves mid-answer, and one waiting for a whole answer that gives
    up, both abort their request and free its blocks. In process with a gated runner, so the
    request is provably unfinished when the client leaves, on any machine."""
    engine, runner, app = gated_engine()

    def metric(name: str) -> float:
        line = next(x for x in engine.metrics.render().splitlines() if x.startswith(f"vllm:{name}{{"))
        return float(line.rsplit(" ", 1)[1])

    async def main():
        engine.start(asyncio.get_running_loop())
        streamed = AsgiCall(app, {"prompt": list(range(200)), "max_tokens": 300, "stream": True}).start()
        runner.allow(4)
        await streamed.body_until(b"data:")                 # tokens are streaming, 300 would take 300 steps
        assert metric("kv_cache_usage_perc") > 0 and engine.counts["finished"] == 0
        streamed.left.set()
        await asyncio.wait_for(streamed.task, 30)
        runner.open()
        await until(lambda: engine.counts["aborted"] == 1, "the streamed request aborted")
        await until(lambda: metric("kv_cache_usage_perc") == 0.0, "its blocks freed")

        runner.close()
        whole = AsgiCall(app, {"prompt": [1, 2], "max_tokens": 500}).start()
        runner.allow(1)                                      # its prefill: the server answers "accepted" after a step
        await until(lambda: runner.reached == 2, "the whole-answer request waiting for its second step")
        whole.left.set()                                     # the client's timeout, at a moment of the test's choosing
        await asyncio.wait_for(whole.task, 30)
        started = [m for m in whole.sent._queue if m["type"] == "http.response.start"]
        assert [m["status"] for m in started] == [499]
        runner.open()
        await until(lambda: engine.counts["aborted"] == 2, "the whole-answer request aborted")
        await until(lambda: metric("kv_cache_usage_perc") == 0.0 and metric("num_requests_running") == 0.0,
                    "its blocks freed")
        assert engine.counts["finished"] == 0
        await asyncio.to_thread(engine.stop)

    asyncio.run(main())


def test_a_shutdown_aborts_what_the_grace_period_leaves_and_reports_it():
    """The drain, in process with a gated runner: the request cannot finish during the grace
    period, so it is aborted, its client is told, and the report counts it."""
    from engine.serve.app import shutdown_report

    engine, runner, app = gated_engine()

    async def main():
        engine.start(asyncio.get_running_loop())
        call = AsgiCall(app, {"prompt": [1, 2, 3], "max_tokens": 509, "stream": True, "ignore_eos": True}).start()
        runner.allow(2)
        await call.body_until(b"data:")
        engine.begin_drain("SIGTERM", 0.05)
        await until(lambda: not engine.commands.empty() or engine.counts["aborted"], "the grace period over")
        runner.open()
        tail = await call.body_until(b"shutting down")
        assert b"[DONE]" not in tail
        counts = await asyncio.to_thread(engine.stop)
        return shutdown_report(engine.drain, counts)

    report = asyncio.run(main())
    assert "shut down on SIGTERM: 1 request(s) in flight, 0 finished during the grace period, 1 aborted" in report


def test_sigterm_drains_then_aborts_and_reports():
    """The same through a real process and signal. How far the request gets in the 0.3 s grace
    period depends on the machine, so either end is accepted, if the report and the client agree."""
    proc, url = start_server("--shutdown-grace", "0.3")
    try:
        received: list[str] = []

        def long_request():
            with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                              json={"prompt": [1, 2, 3], "max_tokens": 509, "stream": True}) as r:
                received.extend(line for line in r.iter_lines() if line)

        client = threading.Thread(target=long_request)
        client.start()
        while not received:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        code, err = stop(proc)
        client.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, err
    aborted = "shut down on SIGTERM: 1 request(s) in flight, 0 finished during the grace period, 1 aborted" in err
    finished = "shut down on SIGTERM: 1 request(s) in flight, 1 finished during the grace period, 0 aborted" in err
    assert aborted or finished, err
    if aborted:
        assert "[DONE]" not in received[-1] and "shutting down" in received[-1]   # told, not silently cut
    else:
        assert "[DONE]" in received[-1]


def test_reset_prefix_cache_forgets_cached_blocks_and_keeps_counters(server):
    prompt = [7] * 64

    def cached() -> int:
        reply = complete(server, prompt=prompt, max_tokens=1)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() == 48                      # three whole blocks (the last token is always computed)
    hits = scrape(server)['vllm:prefix_cache_hits_total{model_name="tiny"}']
    assert httpx.post(f"{server}/reset_prefix_cache", timeout=30).status_code == 200
    assert cached() == 0
    assert scrape(server)['vllm:prefix_cache_hits_total{model_name="tiny"}'] == hits     # counters stay monotonic


# ----------------------------------------------------------------------------- text prompts and chat


def test_live_server_with_a_tokenizer_serves_chat_and_text():
    pytest.importorskip("tokenizers")
    proc, url = start_server("--tokenizer", str(TOKENIZER))
    try:
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "Explain the KV cache.", "max_tokens": 3,
                                                          "ignore_eos": True}, timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": "Why batch?"}], "max_completion_tokens": 4,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}) as stream:
            events = [json.loads(line[5:]) for line in stream.iter_lines()
                      if line.startswith("data:") and "[DONE]" not in line]
        chunks = [e for e in events if e["choices"]]
        assert len(chunks) == 4 and chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert events[-1]["usage"]["completion_tokens"] == 4
    finally:
        code, err = stop(proc)
    assert code == 0, err
