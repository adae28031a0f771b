"""server/tool_calls.py without a server: the forced-call schema, and the parsing of outputs."""

import json

import jsonschema
import pytest

from tpfuse.server import tool_calls
from tpfuse.server.schemas import ChatCompletionRequest

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    },
    {"type": "function", "function": {"name": "now"}},
]


def _choice(tool_choice, parallel=True):
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": tool_choice}
    )
    return tool_calls.choice_for(request.tools, request.tool_choice, parallel)


def test_forced_schema_accepts_calls_of_the_chosen_functions_only():
    required = json.loads(_choice("required").grammar.spec)
    jsonschema.validate([{"name": "add", "arguments": {"a": 1}}, {"name": "now", "arguments": {}}], required)
    named = json.loads(
        _choice({"type": "function", "function": {"name": "now"}}, parallel=False).grammar.spec
    )
    jsonschema.validate([{"name": "now", "arguments": {}}], named)
    for bad in ([], [{"name": "add", "arguments": {}}], [{"name": "now", "arguments": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, named)


@pytest.mark.parametrize(
    "text, names",
    [
        ('[{"name": "add", "arguments": {"a": 2}}, {"name": "now", "arguments": {}}]', ["add", "now"]),
        ('<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>', ["add"]),
        ("I would rather not.", None),
        ('[{"name": "rm", "arguments": {}}]', None),
        ('{"name": "add", "arguments": "a=2"}', None),
    ],
)
def test_auto_output_becomes_tool_calls_only_when_it_is_a_call_of_known_functions(text, names):
    calls = tool_calls.parse(text, _choice("auto"))
    assert (calls and [c["function"]["name"] for c in calls]) == names if names else calls is None
    for call in calls or []:
        assert call["id"].startswith("call_") and isinstance(json.loads(call["function"]["arguments"]), dict)


def test_tool_choice_none_shows_no_tools_and_a_named_unknown_function_is_refused():
    assert _choice("none") is None
    with pytest.raises(ValueError, match="not among 'tools'"):
        _choice({"type": "function", "function": {"name": "missing"}})


def test_the_functions_join_the_first_system_message_or_open_one():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}]
    tool_calls.add_to_system_message(messages, _choice("auto"))
    assert len(messages) == 2 and messages[0]["content"].startswith("Be brief.\n\nYou can call")
    assert '"name": "add"' in messages[0]["content"]
    alone = [{"role": "user", "content": "x"}]
    tool_calls.add_to_system_message(alone, _choice("auto"))
    assert [m["role"] for m in alone] == ["system", "user"]
