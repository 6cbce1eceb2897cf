"""The project's one cattrs converter (control messages, the daemon's configuration) and its errors.

Scalars are strict: "4" is not an integer, 1 is not a string, 0 is not false.
A validation error names the path of the bad field (:func:`structure_errors`).
"""

from __future__ import annotations

import json
from typing import Any

import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError


class Invalid(ValueError):
    """A value cattrs cannot take; the message is for people. `field` names the attribute when an attrs
    validator raised it (cattrs reports those against the class, not the attribute)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def _strict_int(value: Any, _type: type) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(f"expected an integer, got {show(value)}")
    return value


def _strict_float(value: Any, _type: type) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Invalid(f"expected a number, got {show(value)}")
    return float(value)


def _strict_str(value: Any, _type: type) -> str:
    if not isinstance(value, str):
        raise Invalid(f"expected a string, got {show(value)}")
    return value


def _strict_bool(value: Any, _type: type) -> bool:
    if not isinstance(value, bool):
        raise Invalid(f"expected true or false, got {show(value)}")
    return value


def show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


converter = cattrs.Converter(forbid_extra_keys=True)
converter.register_structure_hook(int, _strict_int)
converter.register_structure_hook(float, _strict_float)
converter.register_structure_hook(str, _strict_str)
converter.register_structure_hook(bool, _strict_bool)


def structure_errors(exc: BaseException, path: str) -> list[tuple[str, str]]:
    """Every problem cattrs found, as (path of the bad field, what is wrong with it)."""
    if isinstance(exc, ClassValidationError):
        with_notes, without = exc.group_exceptions()
        out = [e for sub, note in with_notes for e in structure_errors(sub, f"{path}.{note.name}")]
        return out + [e for sub in without for e in structure_errors(sub, path)]
    if isinstance(exc, IterableValidationError):
        with_notes, without = exc.group_exceptions()
        out = [e for sub, note in with_notes for e in structure_errors(sub, f"{path}[{note.index}]")]
        return out + [e for sub in without for e in structure_errors(sub, path)]
    if isinstance(exc, ForbiddenExtraKeysError):
        return [(f"{path}.{key}", "unknown key") for key in sorted(exc.extra_fields)]
    if isinstance(exc, KeyError):
        return [(path, "required field missing")]
    if isinstance(exc, Invalid):
        return [(f"{path}.{exc.field}" if exc.field else path, str(exc))]
    if isinstance(exc, (TypeError, AttributeError)) and "items" in str(exc):
        return [(path, "expected a mapping (object or table)")]
    if isinstance(exc, TypeError) and "not iterable" in str(exc):
        return [(path, "expected a list")]
    return [(path, str(exc) or type(exc).__name__)]
