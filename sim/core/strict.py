"""The base of every schema object (catalog entries, scenarios): unknown keys are errors, floats
are finite, and a boolean is never read as a number."""
from __future__ import annotations

import types
import typing
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, model_validator


class StrictModel(BaseModel):
    """Base for every schema object: unknown keys are errors, values are re-validated on assignment."""

    # allow_inf_nan=False: every float field of every schema object is finite (`gt=0` admits .inf)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, data: Any) -> Any:
        # pydantic's lax mode reads `true` as 1: `block_size: true` or `num_requests: true` is a
        # mistake to name, not a block of one token or a run of one request
        if isinstance(data, dict):
            names = _NUMERIC_FIELDS.get(cls)
            if names is None:
                names = _NUMERIC_FIELDS[cls] = _numeric_fields(cls)
            for key in names:          # per instance (a million explicit requests): kept cheap
                value = data.get(key)
                if type(value) is bool:
                    raise ValueError(f"{key}: {str(value).lower()} is a boolean, expected a number")
                if isinstance(value, (list, tuple)):    # `values: [100, true]` is no length of 1 either
                    for i, item in enumerate(value):
                        if type(item) is bool:
                            raise ValueError(f"{key}[{i}]: {str(item).lower()} is a boolean, expected a number")
        return data


def refuse_unread(model: BaseModel, selector: str, readers: dict[str, tuple[str, ...]]) -> None:
    """ValueError for a field that the model's `selector` (its format, process, router) never reads,
    set away from its default: it would change nothing while its writer expects it to (`cv` on a
    poisson process). At its default it passes, since a resolved scenario dump lists every field.
    `readers` maps each such field to the selector values that read it."""
    mode = getattr(model, selector)
    for name, modes in readers.items():
        if (mode not in modes and name in model.model_fields_set
                and getattr(model, name) != type(model).model_fields[name].default):
            raise ValueError(f"{name} is read only with {selector} {' or '.join(modes)}, not {mode}; remove it")


_NUMERIC_FIELDS: dict[type, tuple[str, ...]] = {}
_NUMBERS = {int, float}


def _numeric_fields(model: type[BaseModel]) -> tuple[str, ...]:
    """The fields of `model` that hold only numbers or lists of numbers (int, float, a list or tuple
    of them, optionally None)."""
    def numbers(annotation: Any) -> bool:
        if annotation in _NUMBERS:
            return True
        if typing.get_origin(annotation) in (list, tuple):
            items = set(typing.get_args(annotation)) - {Ellipsis}
            return bool(items) and items <= _NUMBERS
        return False

    def numeric_only(annotation: Any) -> bool:
        union = typing.get_origin(annotation) in (Union, types.UnionType)
        kinds = set(typing.get_args(annotation) if union else (annotation,)) - {type(None)}
        return bool(kinds) and all(numbers(kind) for kind in kinds)

    return tuple(name for name, info in model.model_fields.items() if numeric_only(info.annotation))
