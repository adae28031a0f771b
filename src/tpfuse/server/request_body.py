"""Decoding a request body into JSON values the rest of the server can trust.

Raises RequestError (400, or 413 for an oversized body) for: a body that is not UTF-8, not JSON, or
uses the non-standard NaN / Infinity literals; an integer of more than MAX_INT_DIGITS digits; nesting
deeper than MAX_DEPTH; strings (or object keys) holding lone UTF-16 surrogates (from escapes such as
"\\ud800"), which no tokenizer can encode (messages show them escaped).
Whole numbers written with a fraction part (16.0) decode as integers.
"""

from __future__ import annotations

import json
from typing import Any

from tpfuse.server.errors import RequestError

MAX_BODY_BYTES = 32 << 20
MAX_DEPTH = 32
MAX_INT_DIGITS = 100


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _number(text: str) -> int | float:
    """A JSON number with a fraction part: an int where it is a whole number within int64 (JSON has one
    number type: 16.0 is the integer 16, as JSON Schema's "integer" says), else a float."""
    value = float(text)
    return int(value) if value.is_integer() and abs(value) < 2**63 else value


def _integer(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:
        raise ValueError(f"a number has {len(text)} digits, over the limit of {MAX_INT_DIGITS}")
    return int(text)


def decode_json_body(raw: bytes) -> Any:
    """raw request bytes -> the decoded JSON value, checked as described above."""
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(
            f"the request body has {len(raw)} bytes, over the limit of {MAX_BODY_BYTES}", status=413
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: byte {exc.start} is not UTF-8") from None
    try:
        value = json.loads(text, parse_constant=_no_constants, parse_float=_number, parse_int=_integer)
    except (json.JSONDecodeError, ValueError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise RequestError(f"the request body is nested deeper than {MAX_DEPTH} levels") from None
    _check(value, "", 0)
    return value


def _check(value: Any, path: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise RequestError(f"'{path}' is nested deeper than {MAX_DEPTH} levels", path or None)
    if isinstance(value, str):
        _check_text(value, path)
    elif isinstance(value, dict):
        for key, item in value.items():
            shown = printable(key)
            child = f"{path}.{shown}" if path else shown
            _check_text(key, child)
            if isinstance(item, dict | list | str):
                _check(item, child, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, dict | list | str):
                _check(item, f"{path}[{i}]", depth + 1)


def printable(text: str) -> str:
    """text with each lone surrogate as a backslash escape (such as \\ud800), which UTF-8 can carry."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(
            f"'{path}' holds a lone UTF-16 surrogate (U+{ord(text[exc.start]):04X}) at character "
            f"{exc.start}; send valid Unicode text",
            path or None,
        ) from None
