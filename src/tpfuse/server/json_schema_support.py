"""Which JSON Schemas constrained decoding enforces: `check_json_schema` refuses the rest.

Schemas (response_format's json_schema.schema, the `parameters` of forced tool calls) are compiled to
a grammar by xgrammar, which ignores some keywords without a word, so the output could break the
client's schema. What is not enforced is refused with a RequestError (400) naming the path inside the
schema and the fix, never ignored. tests/server/test_json_schema_support.py proves, with xgrammar's
GrammarMatcher, that every accepted keyword rejects a violating output and that each refusal below is
needed.

Accepted: `type`; object: `properties`, `required`, `additionalProperties`, `minProperties`,
`maxProperties`, `propertyNames`; array: `items`, `prefixItems`, `minItems`, `maxItems`; string:
`minLength`, `maxLength`, `pattern`, `format` (FORMATS); number: `minimum`, `maximum`,
`exclusiveMinimum`, `exclusiveMaximum`, `multipleOf`; `enum`, `const`, `anyOf`, `oneOf`, `allOf` of
one schema, local `$ref` ("#" or "#/..."), `$defs`, `definitions`; `unevaluatedProperties`,
`unevaluatedItems`, `additionalItems`, `uniqueItems`, `nullable` when false; ANNOTATIONS; `$id` at the
root. Bools are schemas.

Refused, because xgrammar ignores it:
- NOT_ENFORCED keywords, unknown keywords, `uniqueItems`/`nullable` true, `allOf` of several schemas,
  a `format` not in FORMATS, unevaluated*/additionalItems as schemas, non-local `$ref`, `$id` below
  the root, lookaround in `pattern`;
- anything but annotations next to `$ref`, `anyOf`, `oneOf`, `allOf`, `enum` or `const` (xgrammar
  reads only that keyword; a `type` that every enum/const value has is fine), and two of them together;
- `pattern` or `format` with min/maxLength, `format` with `pattern`, `multipleOf` for numbers (integers
  only), `propertyNames` beside `properties`, `unevaluatedProperties` or `additionalProperties` false;
- a type-specific keyword without a `type` it applies to (xgrammar infers object from properties or
  additionalProperties, array from items or prefixItems, nothing else);
- `oneOf` whose branches may overlap (xgrammar enforces it as anyOf): branches must differ in type, or
  be objects whose shared required property has different const/enum values;
- `required` naming a property that `properties` does not define (xgrammar drops the name).

`$ref` is never followed (so no cycles; `$defs`/`definitions` are checked where they stand), except
to compare oneOf branches.
"""

from __future__ import annotations

import json
import re
from typing import Any, NoReturn

from tpfuse.server.errors import RequestError

ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$schema", "$comment", "deprecated", "readOnly",
        "writeOnly", "contentMediaType", "contentEncoding", "discriminator",
    }
)  # fmt: skip
STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format"})
NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
ARRAY_KEYWORDS = frozenset(
    {"items", "prefixItems", "minItems", "maxItems", "unevaluatedItems", "additionalItems"}
)
OBJECT_KEYWORDS = frozenset(
    {
        "properties", "required", "additionalProperties", "minProperties", "maxProperties", "propertyNames",
        "unevaluatedProperties",
    }
)  # fmt: skip
COMBINATORS = frozenset({"$ref", "anyOf", "oneOf", "allOf", "enum", "const"})  # xgrammar reads only these
OTHER_KEYWORDS = frozenset({"type", "$defs", "definitions", "nullable", "uniqueItems", "$id"})
NOT_ENFORCED = frozenset(
    {
        "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains",
        "minContains", "maxContains", "patternProperties",
    }
)  # fmt: skip
FORMATS = frozenset(
    {
        "email", "date", "date-time", "time", "duration", "uuid", "uri", "uri-reference", "uri-template",
        "ipv4", "ipv6", "hostname", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip
TYPES = frozenset({"string", "number", "integer", "boolean", "null", "array", "object"})

_KNOWN = ANNOTATIONS | STRING_KEYWORDS | NUMBER_KEYWORDS | ARRAY_KEYWORDS | OBJECT_KEYWORDS
_KNOWN |= COMBINATORS | OTHER_KEYWORDS
_HARMLESS = ANNOTATIONS | {"$defs", "definitions", "$id"}  # fine next to a combinator
_KIND = {
    **dict.fromkeys(STRING_KEYWORDS, ("string",)),
    **dict.fromkeys(NUMBER_KEYWORDS, ("integer", "number")),
    **dict.fromkeys(ARRAY_KEYWORDS, ("array",)),
    **dict.fromkeys(OBJECT_KEYWORDS, ("object",)),
}
_LOOKAROUND = re.compile(r"(?<!\\)\(\?<?[=!]")
_NAME = re.compile(r"^[A-Za-z_$][A-Za-z0-9_$-]*$")
_COMBINATOR_FIX = {
    "$ref": "move it into the referenced schema",
    "anyOf": "move it into each branch",
    "oneOf": "move it into each branch",
    "allOf": "move it into the schema in 'allOf'",
}
_ROOTS = {"response_format": "response_format.json_schema.schema"}
_NO = "is not enforced by tpfuse's constrained decoding"


def check_json_schema(schema: Any, param: str, where: str | None = None) -> None:
    """Raises errors.RequestError(message, param) for the first part of schema that constrained
    decoding would not enforce (see the module docstring). The message starts with the path inside
    the schema, rooted at `where` (default: "response_format.json_schema.schema" for that param, else
    param itself; tools pass e.g. "tools[0].function.parameters")."""
    _Walk(param, schema).check(schema, where or _ROOTS.get(param, param), is_root=True)


class _Walk:
    def __init__(self, param: str, root: Any):
        self.param, self.root = param, root

    def fail(self, path: str, message: str) -> NoReturn:
        raise RequestError(f"{path}: {message}", self.param)

    def check(self, s: Any, path: str, is_root: bool = False, is_name: bool = False) -> None:
        """is_name: s is a propertyNames schema (its values are strings)."""
        if isinstance(s, bool):
            return
        if not isinstance(s, dict):
            self.fail(path, f"a schema must be an object or a boolean, got {json.dumps(s)[:40]}")
        for key, value in s.items():
            self.keyword(key, value, path, is_root)
        types = self.types(s, path)
        self.combinator(s, path, types)
        if not is_name:
            self.kinds(s, path, types)
        self.pairs(s, path, types)
        for key in ("properties", "$defs", "definitions"):
            if key in s:
                if not isinstance(s[key], dict):
                    self.fail(path, f"'{key}' must be an object mapping names to schemas")
                for name, sub in s[key].items():
                    self.check(sub, _join(_join(path, key), name))
        for key in ("items", "additionalProperties", "propertyNames"):
            if key in s:
                self.check(s[key], _join(path, key), is_name=key == "propertyNames")
        for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
            if key in s:
                if not isinstance(s[key], list) or not s[key]:
                    self.fail(path, f"'{key}' must be a non-empty list of schemas")
                for i, sub in enumerate(s[key]):
                    self.check(sub, f"{_join(path, key)}[{i}]")
        if "oneOf" in s:
            self.disjoint(s["oneOf"], _join(path, "oneOf"))

    def keyword(self, key: str, value: Any, path: str, is_root: bool) -> None:
        if key in NOT_ENFORCED:
            self.fail(path, f"'{key}' {_NO}; leave it out")
        if key not in _KNOWN:
            self.fail(path, f"'{key}' is not a JSON Schema keyword tpfuse supports; leave it out")
        if key in ("uniqueItems", "nullable") and value is not False:
            fix = "leave it out" if key == "uniqueItems" else "add 'null' to 'type' instead"
            self.fail(path, f"'{key}': {json.dumps(value)} {_NO}; {fix}")
        if key in ("unevaluatedProperties", "unevaluatedItems", "additionalItems") and value is not False:
            self.fail(path, f"'{key}' other than false {_NO}; leave it out or set it to false")
        if key == "items" and isinstance(value, list):
            self.fail(path, "'items' as a list (the draft-07 tuple form) is not supported; use 'prefixItems'")
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            self.fail(path, f"'allOf' with more than one schema {_NO}; merge them into one schema")
        if key == "format" and (not isinstance(value, str) or value not in FORMATS):
            self.fail(path, f"'format' {json.dumps(value)} {_NO}; use one of {', '.join(sorted(FORMATS))}")
        if key == "$ref" and not (isinstance(value, str) and (value == "#" or value.startswith("#/"))):
            self.fail(path, f"'$ref' {json.dumps(value)[:60]} {_NO}; refer to '#/...' in this schema")
        if key == "$id" and not is_root:
            self.fail(path, f"'$id' below the root {_NO} ('$ref' resolves from the root); leave it out")
        if key == "pattern" and isinstance(value, str) and _LOOKAROUND.search(value):
            self.fail(path, f"lookaround in 'pattern' {_NO}; write the pattern without it")

    def types(self, s: dict, path: str) -> set[str] | None:
        """The schema's `type` as a set (None when absent)."""
        if "type" not in s:
            return None
        names = [s["type"]] if isinstance(s["type"], str) else s["type"]
        if not isinstance(names, list) or not names or any(n not in TYPES for n in names):
            self.fail(path, f"'type' must be one of {', '.join(sorted(TYPES))} or a non-empty list of them")
        return set(names)

    def combinator(self, s: dict, path: str, types: set[str] | None) -> None:
        """xgrammar reads only the combinator: its siblings must constrain nothing (a `type` that every
        enum/const value has is fine)."""
        present = sorted(COMBINATORS & s.keys())
        if len(present) > 1:
            self.fail(path, f"'{present[0]}' next to '{present[1]}' {_NO}; keep one of them")
        if not present:
            return
        comb = present[0]
        for key, value in s.items():
            if key == comb or key in _HARMLESS or (key in ("nullable", "uniqueItems") and value is False):
                continue
            if key == "type" and comb in ("enum", "const"):
                for v in _values(s):
                    if not _value_types(v) & types:
                        bad = f"{comb} value {json.dumps(v)[:40]} is not of 'type' {json.dumps(s['type'])}"
                        self.fail(path, f"{bad}, and 'type' next to '{comb}' {_NO}; fix one of them")
                continue
            fix = _COMBINATOR_FIX.get(comb, "leave it out: the listed values decide")
            self.fail(path, f"'{key}' next to '{comb}' {_NO} (xgrammar reads only '{comb}'); {fix}")

    def kinds(self, s: dict, path: str, types: set[str] | None) -> None:
        """Without `type`, xgrammar ignores type-specific keywords except those it infers object
        (properties, additionalProperties) or array (items, prefixItems) from."""
        if types is not None:
            return
        inferred = set()
        if s.keys() & {"properties", "additionalProperties"}:
            inferred.add("object")
        if s.keys() & {"items", "prefixItems"}:
            inferred.add("array")
        for key in s:
            kinds = _KIND.get(key)
            if kinds and not inferred.intersection(kinds):
                self.fail(path, f"'{key}' without 'type' {_NO}; add 'type': {' or '.join(map(repr, kinds))}")

    def pairs(self, s: dict, path: str, types: set[str] | None) -> None:
        """Keywords xgrammar enforces alone but not together (or not for some type)."""
        if "multipleOf" in s and types and "number" in types:
            self.fail(path, f"'multipleOf' with 'type' 'number' {_NO}; it is with 'type' 'integer'")
        for first, second in (("pattern", "minLength"), ("pattern", "maxLength"), ("format", "minLength"),
                              ("format", "maxLength"), ("format", "pattern")):  # fmt: skip
            if first in s and second in s:
                self.fail(path, f"'{second}' next to '{first}' {_NO}; leave one of them out")
        props = s.get("properties", {})
        if "required" in s:
            if not isinstance(s["required"], list) or not all(isinstance(n, str) for n in s["required"]):
                self.fail(path, "'required' must be a list of property names")
            for name in s["required"]:
                if not isinstance(props, dict) or name not in props:
                    fix = "define it in 'properties' or drop it from 'required'"
                    self.fail(
                        path, f"'required' {json.dumps(name)} without a 'properties' entry {_NO}; {fix}"
                    )
        if "propertyNames" in s:
            for key in ("properties", "unevaluatedProperties", "additionalProperties"):
                if key in s and (key != "additionalProperties" or s[key] is False):
                    self.fail(path, f"'propertyNames' next to '{key}' {_NO}; leave one of them out")

    def disjoint(self, branches: list, path: str) -> None:
        """xgrammar enforces an overlapping oneOf as anyOf; accepted are branches provably disjoint:
        different types, or objects with a shared required property of different const/enum values."""
        resolved = [_deref(b, self.root) for b in branches]
        for i, a in enumerate(resolved):
            for j in range(i):
                if not _disjoint(a, resolved[j], self.root):
                    fix = "use 'anyOf', or make the branches differ in 'type' or in a required 'const'"
                    self.fail(f"{path}[{i}]", f"may overlap oneOf[{j}]; overlapping 'oneOf' {_NO}; {fix}")


def _values(s: dict) -> list:
    """The values an enum/const schema admits."""
    if "const" in s:
        return [s["const"]]
    return s["enum"] if isinstance(s.get("enum"), list) else [s["enum"]]


def _value_types(v: Any) -> set[str]:
    if isinstance(v, bool):
        return {"boolean"}
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return {"integer", "number"}
    names = {float: "number", str: "string", type(None): "null", list: "array", dict: "object"}
    return {names.get(type(v), "?")}


def _deref(s: Any, root: Any) -> Any:
    """s with local $refs and one-schema allOfs resolved (a few hops; None when that fails)."""
    for _ in range(8):
        if not isinstance(s, dict):
            return s
        if isinstance(s.get("allOf"), list) and len(s["allOf"]) == 1:
            s = s["allOf"][0]
        elif isinstance(s.get("$ref"), str):
            target = root
            for part in s["$ref"].removeprefix("#").split("/")[1:]:
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(target, dict) or part not in target:
                    return None
                target = target[part]
            s = target
        else:
            return s
    return None


def _kinds(s: Any) -> set[str] | None:
    """The JSON types s admits ("integer" counted as "number"); None: any, or unknown."""
    if not isinstance(s, dict):
        return set() if s is False else None
    t = s.get("type")
    if isinstance(t, str) or (isinstance(t, list) and all(isinstance(n, str) for n in t)):
        names = {t} if isinstance(t, str) else set(t)
    elif "type" not in s and ("const" in s or "enum" in s):
        names = set().union(*(_value_types(v) for v in _values(s)))
    else:
        return None
    return {"number" if n == "integer" else n for n in names}


def _scalar_keys(s: Any, root: Any) -> set | None:
    """The values an enum/const schema admits as comparable keys (None when not all scalars)."""
    s = _deref(s, root)
    if not isinstance(s, dict) or not ("const" in s or "enum" in s):
        return None
    keys = set()
    for v in _values(s):
        if isinstance(v, bool) or v is None or isinstance(v, str):
            keys.add((type(v).__name__, v))
        elif isinstance(v, int | float):
            keys.add(("number", float(v)))
        else:
            return None
    return keys


def _disjoint(a: Any, b: Any, root: Any) -> bool:
    ka, kb = _kinds(a), _kinds(b)
    if ka is not None and kb is not None and not ka & kb:
        return True
    if ka != {"object"} or kb != {"object"}:
        return False
    for name in _required(a) & _required(b):
        va = _scalar_keys(_properties(a).get(name), root)
        vb = _scalar_keys(_properties(b).get(name), root)
        if va is not None and vb is not None and not va & vb:
            return True
    return False


def _required(s: dict) -> set[str]:
    r = s.get("required")
    return {n for n in r if isinstance(n, str)} if isinstance(r, list) else set()


def _properties(s: dict) -> dict:
    p = s.get("properties")
    return p if isinstance(p, dict) else {}


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if _NAME.match(key) else f"{path}[{json.dumps(key)}]"
