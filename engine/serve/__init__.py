"""`simrun serve`: the paged engine behind an OpenAI-compatible HTTP API.

    POST /v1/completions   prompt as token ids (or text, with --tokenizer); max_tokens, ignore_eos,
                           stream (server-sent events)
    POST /v1/chat/completions  messages (with --tokenizer): the tokenizer's chat template, else
                           'role: content' lines then 'assistant:'
    GET  /v1/models, /version, /health
    GET  /metrics          Prometheus text with vLLM's metric names

One thread runs the engine loop (the shared Scheduler + ModelRunner, as in engine/replay.py);
the asyncio event loop only parses, validates and streams. They meet at two queues: the
event loop hands the engine thread commands (add, abort, stop) through a thread-safe queue,
and the engine thread hands each step's tokens back with one call_soon_threadsafe into
per-request asyncio queues. A slow client therefore never stalls a step, and a step never
blocks the event loop. The engine thread sleeps on its command queue when it has no work.

Untrusted bodies: a body over `--max-body-bytes` is HTTP 413 (refused from its Content-Length,
or as soon as the stream passes the limit); JSON parsing and validation run on a worker thread,
so a large or deeply nested body never stalls the event loop (/health, streams); any malformed
body is HTTP 400, never 500. With `--max-waiting N`, a request arriving while N already wait
for the engine gets HTTP 429. The port is bound before the model is built, so a taken port
fails at once.

Requests are checked before they reach the scheduler (token ids within the vocabulary,
prompt + max_tokens within max_model_len, max_tokens >= 1, n == 1, no sampling option the
engine cannot honour); a bad one gets HTTP 400 with the reason. A client that goes away
aborts its request, which frees its blocks. SIGINT/SIGTERM stop accepting requests, let
in-flight ones finish within a grace period, abort the rest and print one report line.
"""

# protocol.py: the OpenAI request fields, their validation and the completion objects
# engine_loop.py: the engine thread (Scheduler + ModelRunner) and its command queue
# metrics.py: /metrics in vLLM's names; app.py: the HTTP routes; cli.py: `simrun serve`
