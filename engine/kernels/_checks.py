"""Argument checks shared by the Triton wrappers: bad inputs raise ValueError naming the argument
instead of reaching a kernel, which would read out of bounds or fail with an opaque error."""
from __future__ import annotations

import torch


def check_shape(name: str, t: torch.Tensor, spec: int | tuple) -> None:
    """spec: a number of dimensions, or a shape where None matches any size."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    ndim = spec if isinstance(spec, int) else len(spec)
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if isinstance(spec, tuple) and any(w is not None and w != s for w, s in zip(spec, t.shape)):
        want = tuple("*" if w is None else w for w in spec)
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, allowed: tuple) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in allowed]}, got {t.dtype}")


def check_same_device(**tensors: torch.Tensor) -> None:
    (first, ref), *rest = tensors.items()
    for name, t in rest:
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {first} is on {ref.device}")


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
