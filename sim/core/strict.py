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
                if type(data.get(key)) is bool:
                    raise ValueError(f"{key}: {str(data[key]).lower()} is a boolean, expected a number")
        return data


_NUMERIC_FIELDS: dict[type, tuple[str, ...]] = {}


def _numeric_fields(model: type[BaseModel]) -> tuple[str, ...]:
    """The fields of `model` that hold only numbers (int, float, optionally None)."""
    def numeric_only(annotation: Any) -> bool:
        union = typing.get_origin(annotation) in (Union, types.UnionType)
        kinds = set(typing.get_args(annotation) if union else (annotation,)) - {type(None)}
        return bool(kinds) and kinds <= {int, float}

    return tuple(name for name, info in model.model_fields.items() if numeric_only(info.annotation))
