"""Mixture-of-experts feed-forward block (torch reference path): Mixtral and Qwen3-MoE.

A router (linear hidden -> experts) picks each token's top-k experts by softmax probability
(computed in fp32); each expert is a SwiGLU MLP. Tokens are grouped by expert (a stable sort
of the (token, choice) pairs), every expert that received tokens runs one gate_up and one
down matmul over its rows, and the weighted results are summed back per token, which is the
arithmetic of vLLM's fused_moe and of Hugging Face's expert loop. The two families differ in
the routing weights only:
  Mixtral    renormalises the top-k probabilities and keeps them in fp32 for the weighting;
  Qwen3-MoE  renormalises when `norm_topk_prob` is set and casts them to the model dtype.
Parameters use Hugging Face's fused layout (router `gate.weight` [E, H], `experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I]). Weights are random in the engine: loading MoE
checkpoints is not implemented (the simulator models MoE memory and cost; the engine replays
MoE schedules with random weights). tests/engine/test_moe.py checks both against transformers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MoESpec:
    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int            # per expert
    renormalize: bool = True          # divide the top-k probabilities by their sum
    fp32_weights: bool = False        # weight expert outputs by fp32 probabilities (Mixtral)

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoE top_k must be 1..num_experts ({self.num_experts}), got {self.top_k}")

    @classmethod
    def mixtral(cls, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int) -> "MoESpec":
        return cls(hidden_size, num_experts, top_k, intermediate_size, renormalize=True, fp32_weights=True)

    @classmethod
    def qwen3_moe(cls, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                  norm_topk_prob: bool = True) -> "MoESpec":
        return cls(hidden_size, num_experts, top_k, intermediate_size, renormalize=norm_topk_prob)

    @classmethod
    def from_model(cls, spec) -> Optional["MoESpec"]:
        """The MoE block of a catalog ModelSpec, or None for a dense model: qwen3 routes as
        Qwen3-MoE (norm_topk_prob, which its checkpoints set), the llama family as Mixtral."""
        if not spec.num_experts:
            return None
        if spec.shared_expert_intermediate_size:
            raise NotImplementedError(f"{spec.name}: shared experts (Qwen2-MoE, DeepSeek style) are modelled by "
                                      f"the simulator but not built by the engine")
        args = (spec.hidden_size, spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size)
        return cls.qwen3_moe(*args) if spec.architecture == "qwen3" else cls.mixtral(*args)


class Router(nn.Module):
    def __init__(self, spec: MoESpec, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(spec.num_experts, spec.hidden_size, dtype=dtype), requires_grad=False)


class Experts(nn.Module):
    def __init__(self, spec: MoESpec, dtype: torch.dtype):
        super().__init__()
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)


class MoE(nn.Module):
    def __init__(self, spec: MoESpec, dtype: torch.dtype):
        super().__init__()
        self.spec = spec
        self.gate = Router(spec, dtype)
        self.experts = Experts(spec, dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k], expert ids [tokens, k]) of each token's chosen experts."""
        probs = torch.softmax(F.linear(x, self.gate.weight).float(), dim=-1)
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.spec.fp32_weights else weights.to(x.dtype)), experts

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        weights, experts = self.route(x)
        k = self.spec.top_k
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)                 # (token, choice) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()
        rows_of = order // k
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            pairs = order[start:start + n]
            rows = rows_of[start:start + n]
            start += n
            gate, up = F.linear(x[rows], self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts.down_proj[e])
            out.index_add_(0, rows, (y * weights.flatten()[pairs, None]).to(x.dtype))
        return out

    def experts_used(self, x: torch.Tensor) -> int:
        """Distinct experts a batch of tokens routes to: what a decode step must read."""
        return int(torch.unique(self.route(x)[1]).numel())
