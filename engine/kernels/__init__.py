"""Paged-KV kernels: torch references (always importable) and Triton kernels.

`@triton.jit` decides between compiled and interpreted kernels when this package is first
imported, from TRITON_INTERPRET, so set that variable before importing anything under
engine.kernels (tests/conftest.py does). Without triton installed only the references exist.
Note `engine.kernels.paged_attention` is the function; its module is
sys.modules["engine.kernels.paged_attention"] (`from engine.kernels.paged_attention import ...` works).
"""
from __future__ import annotations

import sys

import torch

from .reference import gather_kv, paged_attention_reference, write_kv_reference

try:
    import triton  # noqa: F401
except ImportError:
    _HAVE_TRITON = False
else:
    _HAVE_TRITON = True
    from .kv_write import write_kv  # noqa: F401  (in __all__)
    from .paged_attention import AttentionConfig, paged_attention  # noqa: F401

_TRITON_NAMES = ("write_kv", "paged_attention", "AttentionConfig")
__all__ = ["gather_kv", "paged_attention_reference", "write_kv_reference", "triton_available", *_TRITON_NAMES]


def triton_available() -> bool:
    """True when the Triton kernels can run here: interpreted (TRITON_INTERPRET=1 at import,
    CPU tensors) or compiled with a CUDA device."""
    if not _HAVE_TRITON:
        return False
    return sys.modules[__name__ + ".paged_attention"].INTERPRET or torch.cuda.is_available()


def __getattr__(name: str):
    if name in _TRITON_NAMES:
        raise ImportError(f"{__name__}.{name} needs triton, which is not installed")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
