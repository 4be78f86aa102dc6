"""The OpenAI wire format of `simrun serve`: what a completion or chat body may carry and its
validation (ApiError names the field), and the completion objects sent back."""

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from sim.core.files import excerpt

# Fields a completion request may carry. Sampling is the runner's (one temperature for the
# whole server), so per-request sampling options are accepted only at the value that
# changes nothing: standard clients (vllm bench serve, the openai package) send them so.
SUPPORTED_FIELDS = ("model", "prompt", "max_tokens", "stream", "stream_options", "ignore_eos",
                    "temperature", "n", "user", "return_token_ids")
NEUTRAL_VALUES: dict[str, tuple] = {
    "best_of": (None, 1), "echo": (None, False), "logprobs": (None,), "top_p": (None, 1),
    "top_k": (None, 0, -1), "min_p": (None, 0), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "repetition_penalty": (None, 1), "stop": (None, "", []),
    "stop_token_ids": (None, []), "min_tokens": (None, 0), "seed": (None,), "suffix": (None,),
    "logit_bias": (None, {}),
}


class ApiError(Exception):
    """An error answered to the client (OpenAI's error object); the engine is unaffected."""

    KINDS = {400: "BadRequestError", 404: "NotFoundError", 408: "RequestTimeoutError", 409: "ConflictError",
             413: "RequestEntityTooLargeError",
             429: "RateLimitError", 503: "ServiceUnavailableError", 500: "InternalServerError"}

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.param = status, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.KINDS.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class ServedModel:
    name: str                        # what clients pass as `model`
    root: str                        # catalog name or folder
    vocab_size: int
    max_model_len: int
    temperature: float
    eos_token_id: Optional[int]
    tokenizer: Any = None            # sim.datasets.TextTokenizer: text prompts, chat, decoded answers


@dataclass(frozen=True)
class CompletionParams:
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    chat: bool = False


def parse_completion(body: Any, served: ServedModel) -> CompletionParams:
    """Validate a /v1/completions body; raises ApiError naming the offending field."""
    _check_body(body, served, SUPPORTED_FIELDS)
    prompt = _encode_text(body.get("prompt"), served)
    if isinstance(prompt, list) and len(prompt) >= served.max_model_len:   # before checking each id
        raise ApiError(f"the prompt has {len(prompt)} tokens; this model's maximum context length is "
                       f"{served.max_model_len} tokens", param="prompt")
    prompt = _prompt(prompt, served.vocab_size)
    max_tokens = _max_tokens(body.get("max_tokens"), len(prompt), served.max_model_len)
    _check_choice(body, served.temperature)
    return CompletionParams(prompt, max_tokens, _flag(body, "ignore_eos"), _flag(body, "stream"),
                            _include_usage(body.get("stream_options")))


CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options",
               "ignore_eos", "temperature", "n", "user")


def parse_chat(body: Any, served: ServedModel) -> CompletionParams:
    """Validate a /v1/chat/completions body (needs a tokenizer): the messages become the prompt
    through the tokenizer's chat template, or, without one, kvtwin's plain template
    ('role: content' lines, then 'assistant:')."""
    if served.tokenizer is None:
        raise ApiError("/v1/chat/completions needs a tokenizer: start simrun serve with --tokenizer", 404)
    _check_body(body, served, CHAT_FIELDS)
    messages = _messages(body.get("messages"))
    tok = served.tokenizer
    ids = tok.apply_chat_template(messages) if tok.apply_chat_template else \
        tok.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:")
    prompt = _prompt(ids, served.vocab_size)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _max_tokens(limit, len(prompt), served.max_model_len)
    _check_choice(body, served.temperature)
    return CompletionParams(prompt, max_tokens, _flag(body, "ignore_eos"), _flag(body, "stream"),
                            _include_usage(body.get("stream_options")), chat=True)


def _check_body(body: Any, served: ServedModel, fields: tuple[str, ...]) -> None:
    """A JSON object of known fields, sampling options at neutral values, the served model."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    unknown = sorted(set(body) - set(fields) - set(NEUTRAL_VALUES))
    if unknown:
        raise ApiError(f"unsupported field(s): {', '.join(unknown)}", param=unknown[0])
    for name, allowed in NEUTRAL_VALUES.items():
        if name in body and body[name] not in allowed:
            raise ApiError(f"{name}={excerpt(body[name])} is not supported (allowed: "
                           f"{', '.join(repr(a) for a in allowed)})", param=name)
    _flag(body, "return_token_ids")        # typed though it changes nothing: token_ids are always sent
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise ApiError(f"user must be a string, got {excerpt(body['user'])}", param="user")
    model = body.get("model")
    if model is not None and model != served.name:
        shown = model if isinstance(model, str) and len(model) <= 100 else excerpt(model)
        raise ApiError(f"The model `{shown}` does not exist.", 404, "model")      # vLLM's words


def _messages(messages: Any) -> list[dict]:
    """[{role, content}] with content a string or a list of {type: text, text} parts (vLLM bench)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {role, content}", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise ApiError(f"messages[{i}] needs a role (system, user, assistant)", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(f"messages[{i}].content must be text", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def _encode_text(prompt: Any, served: ServedModel) -> Any:
    """A text prompt as token ids when the server has a tokenizer; anything else unchanged."""
    if isinstance(prompt, str) and served.tokenizer is not None:
        if not prompt:
            raise ApiError("prompt is empty", param="prompt")
        return served.tokenizer.encode(prompt)
    return prompt


def _prompt(prompt: Any, vocab_size: int) -> list[int]:
    if prompt is None:
        raise ApiError("prompt is required: a list of token ids", param="prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
        raise ApiError("prompt as text needs a tokenizer (simrun serve --tokenizer); "
                       "send the prompt as a list of token ids", param="prompt")
    if not isinstance(prompt, list) or not prompt:
        raise ApiError("prompt must be a non-empty list of token ids", param="prompt")
    if isinstance(prompt[0], list):
        raise ApiError("batched prompts (a list of token-id lists) are not supported; "
                       "send one prompt per request", param="prompt")
    for i, token in enumerate(prompt):
        if type(token) is not int:
            raise ApiError(f"prompt[{i}] is {excerpt(token)}: token ids must be integers", param="prompt")
        if not 0 <= token < vocab_size:
            raise ApiError(f"prompt[{i}] = {token} is outside the vocabulary (token ids 0..{vocab_size - 1})",
                           param="prompt")
    return prompt


def _max_tokens(value: Any, prompt_len: int, max_model_len: int) -> int:
    if value is None:                    # vLLM: the room left in the context
        value = max(max_model_len - prompt_len, 1)
    if type(value) is not int:
        raise ApiError(f"max_tokens must be an integer, got {excerpt(value)}", param="max_tokens")
    if value < 1:
        raise ApiError(f"max_tokens must be at least 1, got {excerpt(value)}", param="max_tokens")
    if prompt_len + value > max_model_len:       # vLLM's words; a 4,000-digit value quoted cut short
        raise ApiError(f"This model's maximum context length is {max_model_len} tokens. However, you "
                       f"requested {excerpt(prompt_len + value)} tokens ({prompt_len} in the prompt, "
                       f"{excerpt(value)} in the completion). Please reduce the length of the prompt or "
                       f"completion.", param="max_tokens")
    return value


def _check_choice(body: dict, temperature: float) -> None:
    n = body.get("n", 1)
    if n != 1 or type(n) is not int:
        raise ApiError(f"n={excerpt(n)} is not supported: one completion per request", param="n")
    t = body.get("temperature")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t != temperature):
        raise ApiError(f"temperature={excerpt(t)} is not supported: this server samples every request at "
                       f"temperature {temperature} (simrun serve --temperature)", param="temperature")


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be true or false, got {excerpt(value)}", param=name)
    return value


def _include_usage(options: Any) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise ApiError("stream_options may hold only include_usage", param="stream_options")
    for key in ("include_usage", "continuous_usage_stats"):     # booleans, as vLLM's StreamOptions types them
        if options.get(key) is not None and not isinstance(options[key], bool):
            raise ApiError(f"stream_options.{key} must be true or false, got {excerpt(options[key])}",
                           param=f"stream_options.{key}")
    if options.get("continuous_usage_stats"):
        raise ApiError("stream_options.continuous_usage_stats is not supported", param="stream_options")
    return bool(options.get("include_usage", False))


def parse_body(data: bytes, served: ServedModel, parse=None) -> CompletionParams:
    """JSON and validation of a completion body (run on a worker thread). Any malformed body,
    however it is malformed, is ApiError 400."""
    try:
        body = json.loads(data)
    except RecursionError:
        raise ApiError("the request body nests too deeply") from None
    except ValueError as e:          # JSONDecodeError, bad UTF-8, an integer over 4300 digits
        raise ApiError(f"the request body is not valid JSON ({excerpt(str(e), 120)})") from None
    try:
        return (parse or parse_completion)(body, served)
    except ApiError:
        raise
    except (RecursionError, ValueError, TypeError, OverflowError) as e:   # e.g. comparing nested values
        raise ApiError(f"malformed request body ({type(e).__name__})") from None


@dataclass(frozen=True)
class Event:
    """One message from the engine thread to a request's stream."""

    kind: str                              # accepted | token | rejected | aborted | error
    token: Optional[int] = None
    finish_reason: Optional[str] = None    # on a request's last token: length | stop
    cached_tokens: int = 0
    message: str = ""


@dataclass
class Completion:
    """The OpenAI completion (or chat completion) object, built up token by token. Without a
    tokenizer `text` holds the token ids as decimal numbers separated by spaces; with one, the
    decoded text (an id beyond the tokenizer's vocabulary, which only a model with random weights
    samples, reads `<id>`). `token_ids` holds the ids as integers (completions only)."""

    model: str
    prompt_tokens: int
    chat: bool = False
    tokenizer: Any = None
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    cached_tokens: int = 0
    finish_reason: Optional[str] = None

    def add(self, event: Event) -> str:
        """Record a token event; returns its text piece."""
        self.tokens.append(event.token)
        piece = self._piece()
        self.text += piece
        self.cached_tokens, self.finish_reason = event.cached_tokens, event.finish_reason
        return piece

    def _piece(self) -> str:
        token = self.tokens[-1]
        tok = self.tokenizer
        if tok is None:
            return ("" if len(self.tokens) == 1 else " ") + str(token)
        if token >= tok.vocab_size:
            return f"<{token}>"
        # decode a short window, so a character spread over several byte tokens comes out whole
        window = [t for t in self.tokens[-6:] if t < tok.vocab_size]
        return tok.decode(window)[len(tok.decode(window[:-1])):]

    def head(self, chunk: bool = True) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self) -> dict:
        n = len(self.tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def choice(self, text: str, token_ids: list[int]) -> dict:
        if self.chat:
            delta = {"content": text} if len(self.tokens) > 1 else {"role": "assistant", "content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": self.finish_reason}
        return {"index": 0, "text": text, "token_ids": token_ids, "logprobs": None,
                "finish_reason": self.finish_reason, "stop_reason": None}

    def whole(self) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text}, "logprobs": None,
                      "finish_reason": self.finish_reason}
        else:
            choice = self.choice(self.text, self.tokens)
        return {**self.head(chunk=False), "choices": [choice], "usage": self.usage()}
