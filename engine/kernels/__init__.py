"""Paged-KV kernels: torch references (always importable) and Triton kernels (lazy).

`write_kv` and `paged_attention` are imported on first access, not with this package:
`@triton.jit` reads TRITON_INTERPRET when the kernel module is imported, so deferring it
lets a test harness set the variable first, and a machine without triton can still use
the references.
"""
from __future__ import annotations

import importlib
import importlib.util
import os

from .reference import gather_kv, paged_attention_reference, write_kv_reference

_LAZY = {"write_kv": ".kv_write", "paged_attention": ".paged_attention",
         "AttentionConfig": ".paged_attention"}

__all__ = ["gather_kv", "paged_attention_reference", "write_kv_reference", "triton_available", *_LAZY]


def triton_available() -> bool:
    """True when the Triton kernels can run here: triton is installed and there is a CUDA
    device or TRITON_INTERPRET=1 (CPU tensors through the interpreter)."""
    if importlib.util.find_spec("triton") is None:
        return False
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"):
        return True
    import torch
    return torch.cuda.is_available()


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)
