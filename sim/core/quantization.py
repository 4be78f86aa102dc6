"""How a checkpoint stores its quantized linear weights (a model's `quantization`), and their bytes."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from sim.core.strict import StrictModel


class WeightQuant(StrictModel):
    """How a checkpoint stores its decoder's linear weights (vLLM's `quantization_config`).

    Embeddings, the LM head, norms and the MoE router stay in the model dtype, as vLLM keeps them.
    fp8 / int8 hold one byte per weight plus fp32 scales per tensor, per output channel or per
    `block` (DeepSeek-style [128, 128] tiles); awq / gptq hold 4-bit weights plus an fp16 scale
    (and a 4-bit zero point when `zero_point`) per `group_size` inputs of each output channel;
    mxfp4 (gpt-oss) holds 4-bit weights plus one byte of shared exponent per 32.
    """

    method: Literal["fp8", "int8", "awq", "gptq", "mxfp4"] = Field(
        description="the checkpoint's format: fp8 | int8 (one byte a weight) | awq | gptq (4-bit, group "
                    "scales) | mxfp4 (gpt-oss)")
    scales: Literal["tensor", "channel", "block", "group"] = Field(
        default="channel",
        description="what one scale covers: a tensor, an output channel, a `block`, or `group_size` inputs")
    group_size: Optional[int] = Field(
        default=None, gt=0, le=2**20,
        description="inputs per scale for group scales (AWQ / GPTQ default 128, mxfp4 32)")
    block: Optional[tuple[int, int]] = Field(
        default=None,
        description="fp8 block scales' tile [out, in], e.g. [128, 128]")
    zero_point: bool = Field(
        default=False,
        description="int4 asymmetric: a 4-bit zero point per group (AWQ's default; GPTQ sym=false)")
    act_order: bool = Field(default=False, description="GPTQ desc_act: an int32 g_idx per input")
    quantized_activations: bool = Field(
        default=True,
        description="W8A8: GEMMs on the fp8 / int8 tensor cores; false = weight-only (dequantized to 16 "
                    "bits, at 0.8 x the 16-bit peak)")
    experts_only: bool = Field(
        default=False,
        description="only the MoE experts are quantized (gpt-oss's mxfp4)")

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, v: Any) -> Any:
        """int4 and mxfp4 formats are weight-only with group scales; fill what they imply."""
        if not isinstance(v, dict) or v.get("method") not in ("awq", "gptq", "mxfp4"):
            return v
        v = {**v, "quantized_activations": False}
        if v["method"] == "mxfp4":
            v.setdefault("group_size", 32)
        elif v.get("scales") in (None, "group"):
            v.setdefault("group_size", 128)          # what AutoAWQ and GPTQ checkpoints use
        if v["method"] == "awq":
            v.setdefault("zero_point", True)         # AWQ's GEMM format is asymmetric
        if v.get("group_size") is not None and v.get("scales") in (None, "channel"):
            v["scales"] = "group"
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "WeightQuant":
        if self.scales == "block" and self.block is None:
            raise ValueError("scales 'block' needs block: [out, in] (e.g. [128, 128])")
        if self.scales == "group" and self.group_size is None:
            raise ValueError("scales 'group' needs group_size")
        return self

    @property
    def weight_bits(self) -> int:
        return 8 if self.method in ("fp8", "int8") else 4

    def matrix_bytes(self, fan_in: int, fan_out: int) -> int:
        """Bytes of one quantized [fan_out, fan_in] weight with its scales (and zero points)."""
        data = fan_in * fan_out * self.weight_bits // 8
        if self.method == "mxfp4":
            return data + fan_out * -(-fan_in // self.group_size)        # one e8m0 byte per 32
        if self.scales == "tensor":
            return data + 4
        if self.scales == "channel":
            return data + 4 * fan_out
        if self.scales == "block":
            bo, bi = self.block
            return data + 4 * -(-fan_out // bo) * -(-fan_in // bi)
        groups = -(-fan_in // self.group_size) * fan_out
        extra = groups * 2 + (groups // 2 if self.zero_point else 0)    # fp16 scale, packed 4-bit zero
        if self.act_order:
            extra += 4 * fan_in
        return data + extra
