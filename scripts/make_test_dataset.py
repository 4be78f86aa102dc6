"""Writes tests/data/datasets/: a small ShareGPT-format conversation file, a plain-text prompt
file, a sonnet-style line file, and a tiny byte-level BPE tokenizer trained on them.

All text is written here for kvtwin's tests (no third-party data). Run from the repo root:
    python scripts/make_test_dataset.py
The tokenizer has 400 tokens (below the `tiny` model's 1024), so `simrun serve --model tiny`
can take its ids; byte-level BPE encodes any text without an unknown token.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "datasets"

TOPICS = ["paged attention", "continuous batching", "prefix caching", "chunked prefill", "tensor parallelism",
          "speculative decoding", "quantized weights", "the KV cache", "request preemption", "the block table",
          "decode steps", "prompt processing", "memory planning", "the scheduler", "token budgets"]
QUESTIONS = ["Explain {t} in two sentences.", "Why does {t} matter for serving throughput?",
             "What goes wrong with {t} when the GPU runs out of memory?",
             "Give an example where {t} lowers the time to first token.",
             "Compare {t} with the simplest alternative, and say which one a small server should use."]
ANSWER_PARTS = ["It keeps the accelerator busy while requests arrive at different times.",
                "Memory is handed out in fixed blocks, so little of it is wasted.",
                "A long prompt can be split so that short requests are not stuck behind it.",
                "Requests that share a system prompt reuse the same cached blocks.",
                "When memory runs short, the newest request is paused and recomputed later.",
                "The cost of a step grows with the number of tokens it touches.",
                "Small batches leave most of the arithmetic units idle.",
                "The answer depends on the ratio of prompt tokens to generated tokens."]
SYSTEM = "You are a careful assistant who answers questions about LLM serving systems."


def conversations(rng: random.Random) -> list[dict]:
    out = []
    for i in range(40):
        turns = []
        if i % 3 == 0:
            turns.append({"from": "system", "value": SYSTEM})
        for _ in range(rng.choice([1, 1, 2, 3])):
            turns.append({"from": "human", "value": rng.choice(QUESTIONS).format(t=rng.choice(TOPICS))})
            turns.append({"from": "gpt", "value": " ".join(rng.choice(ANSWER_PARTS)
                                                           for _ in range(rng.randint(1, 6)))})
        out.append({"id": f"conv-{i:03d}", "conversations": turns})
    out.append({"id": "conv-empty", "conversations": []})                       # skipped by loaders
    out.append({"id": "conv-no-answer", "conversations": [{"from": "human", "value": "Hello?"}]})
    return out


def sonnet_lines(rng: random.Random) -> list[str]:
    words = ["memory", "blocks", "tokens", "queue", "batch", "cache", "prompt", "answer", "clock", "step"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 9))).capitalize() + "," for _ in range(60)]


def main() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(14)
    OUT.mkdir(parents=True, exist_ok=True)
    convs = conversations(rng)
    (OUT / "sharegpt_small.json").write_text(json.dumps(convs, indent=1) + "\n")
    prompts = [rng.choice(QUESTIONS).format(t=t) for t in TOPICS for _ in range(2)]
    (OUT / "prompts.txt").write_text("\n".join(prompts) + "\n")
    lines = sonnet_lines(rng)
    (OUT / "sonnet_small.txt").write_text("\n".join(lines) + "\n")

    corpus = [t["value"] for c in convs for t in c["conversations"]] + prompts + lines
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(OUT / "tokenizer.json"))
    print(f"wrote {OUT}: {len(convs)} conversations, {len(prompts)} prompts, {len(lines)} sonnet lines, "
          f"tokenizer of {tok.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
