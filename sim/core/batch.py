"""One step's work as the scheduler hands it to a driver: which requests compute how many new
tokens, and the step's shape (contexts, blocks read) that the cost model prices."""
from __future__ import annotations

from dataclasses import dataclass

from sim.core.request import Request


@dataclass(frozen=True)
class StaticBatch:
    """The static batch running now: its rows, the padded prompt length, the step that formed it."""

    rows: int
    length: int
    first_step: int


_NO_DRAFTS: dict = {}      # (shared and never written: a step without speculation makes no dict)


def _draft_pairs(start: int, drafted: int) -> int:
    """Causal score pairs of a decode's `drafted` draft queries after its own token at `start`."""
    return drafted * start + (drafted + 1) * (drafted + 2) // 2 - 1


class Batch:
    """One step's work: which requests compute how many new tokens, plus its composition.

    Decodes (one generated token fed back) and prefills (whole prompts, chunks, recomputes)
    are kept apart, so the hot decode path needs no per-sequence token count.
    """

    __slots__ = ("step", "decodes", "num_decode", "pad_rows", "pad_len", "cohort_size", "prefills", "prefill_new",
                 "decode_ctx", "num_prefill_tokens", "prefill_ctx", "prefill_attn", "blocks_read", "preempted",
                 "admitted", "spec_drafts", "spec_tokens", "spec_attn", "lora")

    def __init__(self, step: int):
        self.step = step
        # cohort members first (where the scheduler lists them: Scheduler.lists_members), then
        # decodes scheduled one by one
        self.decodes: list[Request] = []
        self.cohort_size = 0
        # Decode rows computed: len(decodes) + pad_rows, kept as they change (the cost model and
        # the recorder read it every step; a property read is a call)
        self.num_decode = 0
        self.pad_rows = 0            # static batching: rows computed for members that finished
        self.pad_len = 0             # static batching: the padded length every row reaches this step
        self.prefills: list[Request] = []
        self.prefill_new: list[int] = []
        self.decode_ctx = 0          # sum of decode context lengths (tokens attended)
        self.num_prefill_tokens = 0  # prompt tokens computed (whole prompts and chunks)
        self.prefill_ctx = 0         # sum of cached context the prefill chunks attend to
        self.prefill_attn = 0        # sum over chunks of q x (context + (q + 1) / 2): causal score pairs
        self.blocks_read = 0         # KV blocks the attention kernels walk
        self.preempted: list[Request] = []
        self.admitted: list[Request] = []
        # Speculative decoding (sim/core/speculative.py): decodes that verify drafts, with their
        # draft counts; the draft tokens; their causal score pairs past the decode's own token.
        self.spec_drafts: dict = _NO_DRAFTS
        self.spec_tokens = 0
        self.spec_attn = 0
        # LoRA (sim/core/lora.py): the step's adapter figures (a LoraStep), None without LoRA.
        self.lora = None

    def __len__(self) -> int:
        return len(self.decodes) + len(self.prefills)

    @property
    def num_seqs(self) -> int:
        return self.num_decode + len(self.prefills)

    @property
    def num_tokens(self) -> int:
        """Tokens computed (with a static batch's padding once `Scheduler.schedule` returned it)."""
        return self.num_prefill_tokens + self.num_decode + self.spec_tokens

    @property
    def reqs(self) -> list[Request]:
        return self.decodes + self.prefills

    @property
    def num_new(self) -> list[int]:
        drafts = self.spec_drafts
        if drafts:
            return [1 + drafts.get(r, 0) for r in self.decodes] + self.prefill_new
        return [1] * len(self.decodes) + self.prefill_new

    def starts(self) -> list[int]:
        """Context length before this step, per sequence in `reqs` order."""
        return [r.num_computed - n for r, n in zip(self.reqs, self.num_new)]

    def add(self, req: Request, n: int, block_size: int) -> None:
        """Schedule `n` new tokens of `req` (its num_computed advances now, as in vLLM).
        Requests are added one by one, so never as cohort members: their fields are their progress."""
        assert req.cohort is None
        start = req.num_computed
        ctx = start + n
        tokens = req.prompt_len + req.num_output
        self.blocks_read += -(-ctx // block_size)
        # A decode is the one token that completes the sequence. A resumed request's 1-token
        # recompute chunk that leaves more to compute is a prefill chunk: it emits nothing.
        if n == 1 and req.num_output and ctx == tokens:
            self.decodes.append(req)
            self.num_decode += 1
            self.decode_ctx += ctx
        else:
            self.prefills.append(req)
            self.prefill_new.append(n)
            self.num_prefill_tokens += n
            self.prefill_ctx += start
            self.prefill_attn += n * start + n * (n + 1) // 2
            if ctx < tokens:                     # a chunk that emits nothing: remember its step
                req.chunk_steps.append(self.step)
        req.num_computed = ctx

    def add_spec(self, req: Request, n: int, block_size: int) -> None:
        """Schedule a decode that verifies `n - 1` draft tokens (speculative decoding): a decode
        row whose extra query tokens the cost model prices as tokens and attention pairs."""
        assert req.cohort is None
        start = req.num_computed
        drafted = n - 1
        self.blocks_read += -(-(start + n) // block_size)
        self.decodes.append(req)
        self.num_decode += 1
        self.decode_ctx += start + 1
        if self.spec_drafts is _NO_DRAFTS:
            self.spec_drafts = {}
        self.spec_drafts[req] = drafted
        self.spec_tokens += drafted
        self.spec_attn += _draft_pairs(start, drafted)
        req.num_computed = start + n

    def remove(self, req: Request, block_size: int) -> int:
        """Take a request back out (it was preempted after being scheduled); returns its tokens.
        A cohort member, scheduled with the cohort, is taken out before it leaves: `decodes` lists
        the members only where the scheduler lists them (Scheduler.lists_members)."""
        ctx = req.num_computed
        listed = req in self.decodes
        if listed or req.cohort is not None:
            if listed:
                i = self.decodes.index(req)
                del self.decodes[i]
                self.cohort_size -= i < self.cohort_size
            else:                            # an unlisted member
                self.cohort_size -= 1
            self.num_decode -= 1
            n = 1
            drafted = self.spec_drafts.pop(req, 0) if self.spec_drafts else 0
            if drafted:                      # (a decode verifying drafts: its context is its own token's)
                n += drafted
                self.spec_tokens -= drafted
                self.spec_attn -= _draft_pairs(ctx - n, drafted)
            self.decode_ctx -= ctx - drafted
        else:
            i = self.prefills.index(req)
            del self.prefills[i]
            n = self.prefill_new.pop(i)
            start = ctx - n
            self.num_prefill_tokens -= n
            self.prefill_ctx -= start
            self.prefill_attn -= n * start + n * (n + 1) // 2
            if req.chunk_steps and req.chunk_steps[-1] == self.step:
                req.chunk_steps.pop()
        self.blocks_read -= -(-ctx // block_size)
        return n

    def pad_static(self, static: StaticBatch, block_size: int) -> None:
        """Make a static batch's step the padded one HF `generate` computes.

        The forming step is one [B, P] prefill, P the longest sequence; step k after it feeds
        one token per row to all B rows, each attending P + k positions, whether its member
        finished or not. Only the cost figures change: the members' own progress is untouched.
        """
        rows, length = static.rows, static.length
        if self.step == static.first_step:
            self.pad_len = length
            self.num_prefill_tokens = rows * length
            self.prefill_ctx = 0
            self.prefill_attn = rows * (length * (length + 1) // 2)
            self.blocks_read = rows * -(-length // block_size)
            return
        ctx = length + self.step - static.first_step     # every prompt was computed when the batch formed
        self.pad_rows = rows - len(self.decodes)
        self.num_decode = rows
        self.pad_len = ctx
        self.decode_ctx = rows * ctx
        self.blocks_read = rows * -(-ctx // block_size)
