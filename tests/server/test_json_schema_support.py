"""check_json_schema: what constrained decoding would not enforce is refused naming its path and the
OpenAI param; what it accepts is proven enforced by xgrammar (a violating output is rejected)."""

import enum
import functools
import json
import uuid
from datetime import date
from typing import Annotated, Literal

import pytest
import xgrammar
from pydantic import BaseModel, Field

from tpfuse.server import json_schema_support as jss
from tpfuse.server.errors import RequestError
from tpfuse.server.json_schema_support import check_json_schema

ROOT = "response_format.json_schema.schema"
I = {"type": "integer"}
S = {"type": "string"}


@functools.cache
def _compiler():
    vocab = [chr(i) for i in range(32, 127)] + ["<eos>"]
    info = xgrammar.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    return xgrammar.GrammarCompiler(info)


def _matches(schema, text: str) -> bool:
    """Whether xgrammar lets the output be exactly text (compact separators: ", " and ": ")."""
    compiled = _compiler().compile_json_schema(json.dumps(schema), any_whitespace=False)
    m = xgrammar.GrammarMatcher(compiled)
    return m.accept_string(text) and m.is_completed()


def _refusal(schema, param="response_format", **kw) -> str:
    with pytest.raises(RequestError) as info:
        check_json_schema(schema, param, **kw)
    assert info.value.param == param and info.value.status == 400
    return info.value.message


def _obj(**props):
    return {"type": "object", "properties": props, "required": list(props)}


CAT = _obj(kind={"const": "cat", "type": "string"}, lives=I)
DOG = _obj(kind={"const": "dog", "type": "string"}, bark=S)

FORMAT_EXAMPLES = {  # format: (valid, invalid)
    "email": ("a@b.co", "nope"),
    "date": ("2024-01-02", "2024-13-02"),
    "date-time": ("2024-01-02T03:04:05Z", "2024-01-02"),
    "time": ("03:04:05Z", "3pm"),
    "duration": ("P1DT2H", "1 day"),
    "uuid": ("123e4567-e89b-12d3-a456-426614174000", "xyz"),
    "uri": ("http://a.b/c", "not a uri"),
    "uri-reference": ("/a/b?c", "a b"),
    "uri-template": ("http://a/{x}", "{x"),
    "ipv4": ("1.2.3.4", "1.2.3"),
    "ipv6": ("2001:db8::1", "g::1"),
    "hostname": ("a.example.com", "-a.com"),
    "json-pointer": ("/a/b~0", "a/b"),
    "relative-json-pointer": ("0/a", "/a"),
}

# (name, schema, valid output, violating output): accepted, and xgrammar rejects the violation
ENFORCED = [
    ("type", {"type": "string"}, '"a"', "1"),
    ("type list", {"type": ["integer", "null"]}, "null", '"a"'),
    ("properties", {"type": "object", "properties": {"a": I}}, '{"a": 1}', '{"a": "x"}'),
    ("required", _obj(a=I), '{"a": 1}', "{}"),
    ("additionalProperties false", {**_obj(a=I), "additionalProperties": False}, '{"a": 1}',
     '{"a": 1, "b": 2}'),
    ("additionalProperties schema", {"type": "object", "additionalProperties": I}, '{"b": 2}', '{"b": "x"}'),
    ("additionalProperties true", {**_obj(a=I), "additionalProperties": True}, '{"a": 1, "b": "x"}',
     '{"b": 1}'),
    ("minProperties", {"type": "object", "additionalProperties": I, "minProperties": 1}, '{"a": 1}', "{}"),
    ("maxProperties", {"type": "object", "additionalProperties": I, "maxProperties": 1}, '{"a": 1}',
     '{"a": 1, "b": 2}'),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^a+$"}}, '{"aa": 1}', '{"b": 1}'),
    ("propertyNames + additionalProperties", {"type": "object", "propertyNames": {"maxLength": 2},
     "additionalProperties": True}, '{"ab": 1}', '{"abc": 1}'),
    ("items", {"type": "array", "items": I}, "[1, 2]", '["a"]'),
    ("items false", {"type": "array", "prefixItems": [I], "items": False}, "[1]", "[1, 2]"),
    ("prefixItems", {"type": "array", "prefixItems": [I, S]}, '[1, "a"]', '["a", 1]'),
    ("minItems", {"type": "array", "items": I, "minItems": 2}, "[1, 2]", "[1]"),
    ("maxItems", {"type": "array", "items": I, "maxItems": 1}, "[1]", "[1, 2]"),
    ("uniqueItems false", {"type": "array", "items": I, "uniqueItems": False}, "[1, 1]", '["a"]'),
    ("unevaluatedProperties false", {"type": "object", "unevaluatedProperties": False}, "{}", '{"a": 1}'),
    ("unevaluatedItems false", {"type": "array", "prefixItems": [I], "unevaluatedItems": False}, "[1]",
     "[1, 2]"),
    ("additionalItems false", {"type": "array", "prefixItems": [I], "additionalItems": False}, "[1]",
     "[1, 2]"),
    ("minLength", {"type": "string", "minLength": 2}, '"ab"', '"a"'),
    ("maxLength", {"type": "string", "maxLength": 2}, '"ab"', '"abc"'),
    ("pattern", {"type": "string", "pattern": "^a+$"}, '"aa"', '"ab"'),
    ("pattern with type list", {"type": ["string", "null"], "pattern": "^a+$"}, "null", '"b"'),
    ("minimum", {"type": "integer", "minimum": 5}, "5", "4"),
    ("maximum", {"type": "number", "maximum": 2.5}, "2.5", "2.6"),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0.5}, "0.6", "0.5"),
    ("exclusiveMaximum", {"type": "integer", "exclusiveMaximum": 3}, "2", "3"),
    ("minimum with type list", {"type": ["integer", "string"], "minimum": 5}, '"x"', "1"),
    ("multipleOf", {"type": "integer", "multipleOf": 3}, "6", "4"),
    ("nullable false", {"type": "integer", "nullable": False}, "1", "null"),
    ("enum", {"enum": ["a", 1, None]}, "1", '"b"'),
    ("enum with type", {"enum": ["a", "b"], "type": "string", "title": "E"}, '"b"', '"c"'),
    ("enum of objects", {"enum": [{"a": 1}]}, '{"a":1}', '{"a":2}'),  # values come out compact
    ("const", {"const": "a", "type": "string"}, '"a"', '"b"'),
    ("anyOf", {"anyOf": [I, {"type": "null"}], "default": None}, "null", '"a"'),
    ("oneOf by type", {"oneOf": [I, S]}, '"a"', "true"),
    ("oneOf by const", {"$defs": {"Cat": CAT, "Dog": DOG}, "oneOf": [{"$ref": "#/$defs/Cat"},
     {"$ref": "#/$defs/Dog"}], "discriminator": {"propertyName": "kind"}}, '{"kind": "dog", "bark": "x"}',
     '{"kind": "cat", "bark": "x"}'),
    ("allOf of one", {"allOf": [{"$ref": "#/$defs/A"}], "description": "d", "$defs": {"A": I}}, "1", '"a"'),
    ("$ref", {"$defs": {"A": I}, "$ref": "#/$defs/A", "title": "t"}, "1", '"a"'),
    ("definitions", {"definitions": {"a/b": I}, **_obj(x={"$ref": "#/definitions/a~1b"})}, '{"x": 1}',
     '{"x": "a"}'),
    ("$ref to root", {**_obj(v=I, c={"anyOf": [{"$ref": "#"}, {"type": "null"}]})},
     '{"v": 1, "c": {"v": 2, "c": null}}', '{"v": 1, "c": {"v": "x", "c": null}}'),
    ("no type: properties", {"properties": {"a": I}, "required": ["a"], "minProperties": 1}, '{"a": 1}',
     "{}"),
    ("no type: items", {"items": I, "minItems": 1}, "[1]", "[]"),
    ("annotations", {"$id": "urn:x", **dict.fromkeys(jss.ANNOTATIONS - {"discriminator"}, "x"),
     "discriminator": {"propertyName": "k"}, "type": "integer"}, "1", '"a"'),
] + [(f"format {f}", {"type": "string", "format": f}, json.dumps(ok), json.dumps(bad))
     for f, (ok, bad) in FORMAT_EXAMPLES.items()]  # fmt: skip


@pytest.mark.parametrize("name,schema,valid,violating", ENFORCED, ids=[c[0] for c in ENFORCED])
def test_accepted_keyword_is_enforced_by_xgrammar(name, schema, valid, violating):
    check_json_schema(schema, "response_format")
    assert _matches(schema, valid), f"{name}: xgrammar rejects valid {valid}"
    assert not _matches(schema, violating), f"{name}: xgrammar lets {violating} through"


def _keys(schema) -> set[str]:
    if isinstance(schema, list):
        return set().union(*map(_keys, schema)) if schema else set()
    if not isinstance(schema, dict):
        return set()
    return set(schema) | set().union(*(_keys(v) for v in schema.values()))


def test_every_accepted_keyword_and_format_is_proven():
    accepted = jss.STRING_KEYWORDS | jss.NUMBER_KEYWORDS | jss.ARRAY_KEYWORDS | jss.OBJECT_KEYWORDS
    accepted |= jss.COMBINATORS | jss.OTHER_KEYWORDS | jss.ANNOTATIONS
    assert accepted - _keys([c[1] for c in ENFORCED]) == set()
    assert set(FORMAT_EXAMPLES) == jss.FORMATS


# (name, schema, path below ROOT, word the message names, (output, valid by the schema) that xgrammar
# judges the other way, or None)
REFUSED = [
    ("not", {"type": "integer", "not": {"const": 1}}, "", "'not'", ("1", False)),
    ("if", {"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}}, "", "'if'", ("7", False)),
    ("then", {"type": "integer", "then": {"multipleOf": 2}}, "", "'then'", None),
    ("else", {"type": "integer", "else": {"const": 0}}, "", "'else'", None),
    ("allOf of two", {"allOf": [I, {"type": "integer", "minimum": 5}]}, "", "'allOf'", ("1", False)),
    ("dependentRequired", {**_obj(a=I), "properties": {"a": I, "b": I}, "dependentRequired": {"a": ["b"]}},
     "", "'dependentRequired'", ('{"a": 1}', False)),
    ("dependentSchemas", {"type": "object", "properties": {"a": I, "b": I},
     "dependentSchemas": {"a": {"required": ["b"]}}}, "", "'dependentSchemas'", ('{"a": 1}', False)),
    ("dependencies", {"type": "object", "properties": {"a": I, "b": I}, "dependencies": {"a": ["b"]}}, "",
     "'dependencies'", ('{"a": 1}', False)),
    ("uniqueItems", {"type": "array", "items": I, "uniqueItems": True}, "", "'uniqueItems'",
     ("[1, 1]", False)),
    ("contains", {"type": "array", "items": I, "contains": {"const": 5}}, "", "'contains'", ("[1]", False)),
    ("minContains", {"type": "array", "minContains": 2}, "", "'minContains'", None),
    ("maxContains", {"type": "array", "maxContains": 2}, "", "'maxContains'", None),
    ("patternProperties", {"type": "object", "patternProperties": {"^a": I}}, "", "'patternProperties'",
     ('{"a": 1, "ab": 2}', True)),
    ("format unknown", {"type": "string", "format": "bogus"}, "", "'format' \"bogus\"", None),
    ("format ignored by xgrammar", {"type": "string", "format": "iri"}, "", "'format' \"iri\"",
     ('"not a uri"', False)),
    ("unevaluatedProperties schema", {"type": "object", "unevaluatedProperties": I}, "",
     "'unevaluatedProperties'", None),
    ("unevaluatedItems schema", {"type": "array", "unevaluatedItems": I}, "", "'unevaluatedItems'", None),
    ("additionalItems schema", {"type": "array", "additionalItems": I}, "", "'additionalItems'", None),
    ("nullable true", {"type": "integer", "nullable": True}, "", "'nullable'", ("null", True)),
    ("unknown keyword", {"type": "integer", "foo": 1}, "", "'foo'", None),
    ("$anchor", {"type": "integer", "$anchor": "a"}, "", "'$anchor'", None),
    ("vendor extension", {"type": "integer", "x-order": 1}, "", "'x-order'", None),
    ("non-local $ref", _obj(a={"$ref": "http://x/a.json"}), ".properties.a", "'$ref'", None),
    ("$id below the root", _obj(a={"$id": "urn:a", "type": "integer"}), ".properties.a", "'$id'", None),
    ("lookahead", {"type": "string", "pattern": "(?!x)[a-z]+"}, "", "lookaround", ('"x"', False)),
    ("type next to anyOf", {"type": "integer", "anyOf": [S, I]}, "", "'type' next to 'anyOf'",
     ('"a"', False)),
    ("minimum next to $ref", {"$defs": {"A": I}, **_obj(a={"$ref": "#/$defs/A", "minimum": 5})},
     ".properties.a", "'minimum' next to '$ref'", ('{"a": 1}', False)),
    ("minimum next to allOf", _obj(a={"allOf": [I], "minimum": 5}), ".properties.a",
     "'minimum' next to 'allOf'", ('{"a": 1}', False)),
    ("maxLength next to enum", {"enum": ["a", "bbb"], "maxLength": 1}, "", "'maxLength' next to 'enum'",
     ('"bbb"', False)),
    ("required next to $ref", {"$defs": {"A": {"type": "object", "properties": {"x": I}}},
     "$ref": "#/$defs/A", "required": ["x"]}, "", "'required' next to '$ref'", ("{}", False)),
    ("enum value not of type", {"enum": ["a", 1], "type": "integer"}, "", 'enum value "a"', ('"a"', False)),
    ("const next to enum", {"const": "a", "enum": ["b"]}, "", "'const' next to 'enum'", ('"a"', False)),
    ("$ref next to anyOf", {"$defs": {"A": I}, "$ref": "#/$defs/A", "anyOf": [{**I, "minimum": 5}]}, "",
     "'$ref' next to 'anyOf'", ("1", False)),
    ("maxLength next to pattern", {"type": "string", "pattern": "^a+$", "maxLength": 2}, "",
     "'maxLength' next to 'pattern'", ('"aaaa"', False)),
    ("minLength next to pattern", {"type": "string", "pattern": "^a+$", "minLength": 3}, "",
     "'minLength' next to 'pattern'", ('"a"', False)),
    ("minLength next to format", {"type": "string", "format": "email", "minLength": 20}, "",
     "'minLength' next to 'format'", ('"a@b.co"', False)),
    ("maxLength next to format", {"type": "string", "format": "email", "maxLength": 5}, "",
     "'maxLength' next to 'format'", ('"abc@def.com"', False)),
    ("pattern next to format", {"type": "string", "format": "email", "pattern": "^x"}, "",
     "'pattern' next to 'format'", ('"a@b.co"', False)),
    ("multipleOf for numbers", {"type": "number", "multipleOf": 0.5}, "", "'multipleOf'", ("0.3", False)),
    ("propertyNames next to properties", {"type": "object", "properties": {"b": I},
     "propertyNames": {"pattern": "^a"}}, "", "'propertyNames' next to 'properties'", ('{"b": 1}', False)),
    ("propertyNames next to additionalProperties false", {"type": "object",
     "propertyNames": {"pattern": "^a"}, "additionalProperties": False}, "",
     "'propertyNames' next to 'additionalProperties'", ('{"a": 1}', False)),
    ("propertyNames next to unevaluatedProperties", {"type": "object", "propertyNames": {"pattern": "^a"},
     "unevaluatedProperties": False}, "", "'propertyNames' next to 'unevaluatedProperties'",
     ('{"a": 1}', False)),
    ("minimum without type", {"minimum": 5}, "", "'minimum' without 'type'", ("1", False)),
    ("maxLength without type", {"maxLength": 1}, "", "'maxLength' without 'type'", ('"abc"', False)),
    ("pattern without type", {"pattern": "^a$"}, "", "'pattern' without 'type'", ('"b"', False)),
    ("format without type", {"format": "email"}, "", "'format' without 'type'", ('"b"', False)),
    ("multipleOf without type", {"multipleOf": 3}, "", "'multipleOf' without 'type'", ("4", False)),
    ("exclusiveMaximum without type", {"exclusiveMaximum": 3}, "", "'exclusiveMaximum'", ("3", False)),
    ("minItems without type", {"minItems": 2}, "", "'minItems' without 'type'", ("[1]", False)),
    ("maxItems without type", {"maxItems": 0}, "", "'maxItems' without 'type'", ("[1]", False)),
    ("required without type", {"required": ["a"]}, "", "'required' without 'type'", ("{}", False)),
    ("minProperties without type", {"minProperties": 1}, "", "'minProperties'", ("{}", False)),
    ("propertyNames without type", {"propertyNames": {"pattern": "^a"}}, "", "'propertyNames'",
     ('{"b": 1}', False)),
    ("minimum beside properties, no type", {"properties": {"a": I}, "minimum": 1}, "", "'minimum'", None),
    ("oneOf overlapping types", {"oneOf": [I, {"type": "number"}]}, ".oneOf[1]", "oneOf[0]", ("1", False)),
    ("oneOf objects", {"oneOf": [{"type": "object", "properties": {"a": I}},
     {"type": "object", "properties": {"b": I}}]}, ".oneOf[1]", "'anyOf'", ("{}", False)),
    ("oneOf optional discriminator", {"oneOf": [{"type": "object", "properties": {"k": {"const": "x"}}},
     {"type": "object", "properties": {"k": {"const": "y"}}}]}, ".oneOf[1]", "'oneOf'", ("{}", False)),
    ("required not in properties", {**_obj(x=I), "required": ["x", "a"]}, "", "'required' \"a\"",
     ('{"x": 1}', False)),
    ("required, additionalProperties true", {"type": "object", "additionalProperties": True,
     "required": ["a"]}, "", "'required' \"a\"", ("{}", False)),
    ("required, additionalProperties schema", {"type": "object", "additionalProperties": I,
     "required": ["a"]}, "", "'required' \"a\"", ("{}", False)),
    ("required, no properties", {"type": "object", "required": ["a"]}, "", "'required' \"a\"", ("{}", False)),
    ("schema not an object", _obj(a=5), ".properties.a", "must be an object or a boolean", None),
    ("items as a list", {"type": "array", "items": [I]}, "", "'prefixItems'", None),
    ("unknown type", {"type": "strin"}, "", "'type' must be", None),
    ("anyOf not a list", {"anyOf": I}, "", "'anyOf' must be a non-empty list", None),
    ("required not names", {"type": "object", "required": "a"}, "", "'required' must be a list", None),
]  # fmt: skip


@pytest.mark.parametrize("name,schema,path,word,proof", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_keyword_names_its_path(name, schema, path, word, proof):
    message = _refusal(schema)
    assert message.startswith(f"{ROOT}{path}: "), message
    assert word in message, message
    if proof is not None:  # why it is refused: xgrammar gets this output wrong
        text, valid = proof
        assert _matches(schema, text) != valid, f"{name}: xgrammar now judges {text} right"


@pytest.mark.parametrize(
    "schema,path",
    [
        (_obj(tags={"type": "array", "items": S, "uniqueItems": True}), ".properties.tags"),
        (_obj(xs={"type": "array", "items": {"type": "integer", "not": {}}}), ".properties.xs.items"),
        ({"anyOf": [I, {"type": "string", "format": "bogus"}]}, ".anyOf[1]"),
        ({"type": "array", "prefixItems": [I, {"uniqueItems": True}]}, ".prefixItems[1]"),
        (
            {"$defs": {"Foo": _obj(bar={"type": "integer", "if": {}})}, "$ref": "#/$defs/Foo"},
            ".$defs.Foo.properties.bar",
        ),
        ({"definitions": {"A": {"not": {}}}, **I}, ".definitions.A"),
        (
            {"type": "object", "additionalProperties": {"type": "string", "pattern": "(?=a)"}},
            ".additionalProperties",
        ),
        ({"type": "object", "propertyNames": {"format": "bogus"}}, ".propertyNames"),
        ({"allOf": [{"$ref": "#/$defs/A"}], "$defs": {"A": {"contains": {}}}}, ".$defs.A"),
        (_obj(**{"a.b": {"type": "integer", "foo": 1}}), '.properties["a.b"]'),
    ],
)
def test_nested_refusal_names_the_path(schema, path):
    assert _refusal(schema).startswith(f"{ROOT}{path}: ")


def test_param_and_path_root_for_tools():
    schema = _obj(a={"type": "integer", "not": {}})
    message = _refusal(schema, "tools", where="tools[2].function.parameters")
    assert message.startswith("tools[2].function.parameters.properties.a: 'not' ")
    assert _refusal(schema, "tools").startswith("tools.properties.a: ")


def test_property_names_are_not_keywords():
    check_json_schema(_obj(**{"not": I, "if": S, "format": I, "x-y": I, "": I}), "response_format")


def test_bool_schemas_are_accepted():
    check_json_schema(True, "response_format")
    check_json_schema({"type": "object", "properties": {"a": True}, "additionalProperties": False}, "x")
    check_json_schema({"type": "array", "items": True}, "x")


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=0, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    bark: str


class Address(BaseModel):
    street: str = Field(description="the street")
    zip: str | None = None


class Node(BaseModel):
    value: int
    children: list["Node"] = []


class Person(BaseModel):
    name: str = Field(min_length=1, max_length=40)
    age: int | None = Field(default=None, ge=0)
    color: Color
    mood: Literal["happy", "sad"] = "happy"
    tags: list[str] = []
    address: Address
    home: Address | None = None
    pet: Annotated[Cat | Dog, Field(discriminator="kind")]
    born: date
    id: uuid.UUID
    scores: dict[str, float] = {}
    pair: tuple[int, str]
    tree: Node
    ratio: float = Field(gt=0, lt=1)


def test_pydantic_schema_is_accepted_and_enforced():
    schema = Person.model_json_schema()
    check_json_schema(schema, "response_format")
    tree = Node(value=1, children=[Node(value=2)])
    person = Person(
        name="Ada", color=Color.RED, address=Address(street="Main"), pet=Dog(kind="dog", bark="woof"),
        born=date(2000, 1, 2), id=uuid.UUID(int=7), pair=(1, "a"), tree=tree, ratio=0.5,
    )  # fmt: skip
    valid = person.model_dump(mode="json")
    assert _matches(schema, json.dumps(valid))
    for field, bad in [("pet", {"kind": "cat", "bark": "woof"}), ("color", "blue"), ("ratio", 1)]:
        assert not _matches(schema, json.dumps({**valid, field: bad})), field


def test_pydantic_set_field_is_refused():
    class Tagged(BaseModel):
        tags: set[str]

    message = _refusal(Tagged.model_json_schema())
    assert message.startswith(f"{ROOT}.properties.tags: 'uniqueItems': true is not enforced")
