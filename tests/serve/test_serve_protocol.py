"""`simrun serve`'s wire format in process (engine/serve/protocol.py): vLLM's defaults for a
completion body, text prompts and chat messages through a tokenizer, answers decoded piece by piece."""
from __future__ import annotations

import pytest

from engine.serve.protocol import ApiError, Event, ServedModel, parse_completion
from support import SMOKE_MAX_MODEL_LEN as MAX_MODEL_LEN, TINY_VOCAB as VOCAB, TOKENIZER


SERVED = ServedModel("m", "m", vocab_size=100, max_model_len=64, temperature=0.0, eos_token_id=None)


def test_parse_completion_defaults_follow_vllm():
    params = parse_completion({"prompt": [1, 2, 3]}, SERVED)
    assert params.max_tokens == 61 and not params.stream and not params.ignore_eos   # max_model_len - prompt
    params = parse_completion({"prompt": [1] * 63, "max_tokens": 1, "stream": True,
                               "stream_options": {"include_usage": True}}, SERVED)
    assert params.include_usage and params.stream
    with pytest.raises(ApiError, match="maximum context length is 64"):
        parse_completion({"prompt": [1] * 64}, SERVED)          # no room for one output token
    with pytest.raises(ApiError, match="must be integers"):
        parse_completion({"prompt": [True, 2]}, SERVED)         # a bool is not a token id


@pytest.mark.parametrize("max_tokens", [10**3999, -10**3999], ids=["huge", "huge_negative"])
def test_a_4000_digit_max_tokens_is_quoted_cut_short(max_tokens):
    # below Python's 4,300-digit bound, so it parses: the answer echoed it whole, twice (8 KB)
    with pytest.raises(ApiError) as refused:
        parse_completion({"prompt": [1, 2, 3], "max_tokens": max_tokens}, SERVED)
    assert refused.value.param == "max_tokens" and len(str(refused.value)) < 400, len(str(refused.value))


def _served_with_tokenizer():
    pytest.importorskip("tokenizers")
    from sim.datasets import text_tokenizer

    tok = text_tokenizer(TOKENIZER)
    return ServedModel("m", "m", VOCAB, MAX_MODEL_LEN, 0.0, None, tok), tok


def test_text_prompts_and_chat_messages_are_tokenized():
    from engine.serve.protocol import parse_chat

    served, tok = _served_with_tokenizer()
    params = parse_completion({"prompt": "Explain paged attention.", "max_tokens": 4}, served)
    assert params.prompt == tok.encode("Explain paged attention.") and not params.chat
    chat = parse_chat({"messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": [{"type": "text", "text": "Why?"}]}],
                       "max_completion_tokens": 5, "stream": True}, served)
    assert chat.prompt == tok.encode("system: Be brief.\nuser: Why?\nassistant:") and chat.max_tokens == 5
    with pytest.raises(ApiError, match="prompt as text needs a tokenizer"):
        parse_completion({"prompt": "hi", "max_tokens": 1}, SERVED)
    with pytest.raises(ApiError, match="needs a tokenizer"):
        parse_chat({"messages": [{"role": "user", "content": "hi"}]}, SERVED)
    with pytest.raises(ApiError, match="only text parts"):
        parse_chat({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, served)


def test_answers_are_decoded_piece_by_piece():
    from engine.serve.protocol import Completion

    _, tok = _served_with_tokenizer()
    ids = tok.encode("Memory is handed out in fixed blocks.")
    reply = Completion("m", 3, chat=True, tokenizer=tok)
    pieces = [reply.add(Event("token", token=t)) for t in ids]
    assert "".join(pieces) == tok.decode(ids) == reply.text
    assert reply.whole()["choices"][0]["message"] == {"role": "assistant", "content": tok.decode(ids)}
    assert reply.add(Event("token", token=VOCAB - 1)) == f"<{VOCAB - 1}>"     # beyond the tokenizer
