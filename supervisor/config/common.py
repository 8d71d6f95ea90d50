"""What every config section shares: the error type and strict models."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class ConfigError(Exception):
    pass


class Strict(BaseModel):
    """A config section: unknown keys and wrongly typed values are errors, never coerced."""
    model_config = ConfigDict(extra="forbid", strict=True)


def key_not_below(key: str, bound: str, *, strictly: bool = False):
    """A field validator: key `key` is at least key `bound` (greater, with `strictly`).
    `bound` is declared above `key` in the model, so it is validated first (when it is
    itself invalid, only its own error is reported)."""
    def check(cls, value, info: ValidationInfo):
        limit = info.data.get(bound)
        if limit is not None and (value <= limit if strictly else value < limit):
            raise ValueError(f"must be {'greater than' if strictly else 'at least'} {bound} ({limit})")
        return value
    check.__name__ = f"_{key}_not_below_{bound}"
    return field_validator(key)(classmethod(check))
