"""Tools in chat requests: what the model is shown, the grammar that forces calls, and the parsing of
its output into OpenAI `tool_calls`.

The functions are shown in a system message that asks for calls as a JSON array of
{"name": ..., "arguments": {...}} objects. tool_choice "required" and a named function constrain the
output to such an array (grammar over the functions' parameter schemas; one call unless
parallel_tool_calls); "auto" leaves the output free and turns it into calls only when the whole
output is such an array (or one such object, optionally inside <tool_call> tags) naming known
functions; "none" shows no tools.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from tpfuse.engine.sampling_params import Grammar
from tpfuse.server.json_schema_support import check_json_schema


@dataclass(slots=True)
class ToolChoice:
    functions: list[dict]  # {"name", "description", "parameters"} of the callable functions
    mode: str  # "auto" | "required" | "named"
    parallel: bool
    grammar: Grammar | None  # set when calls are forced


def _function(tool) -> dict:
    f = tool.function
    return {
        "name": f.name,
        "description": f.description or "",
        "parameters": f.parameters or {"type": "object"},
    }


def calls_schema(functions: list[dict], parallel: bool) -> dict:
    """JSON schema of a non-empty array of calls to functions (at most one unless parallel). Each
    function's local references ("#", "#/$defs/X", "#/properties/...") are moved to the outer schema's
    $defs under a prefix of its own, since they resolve from the root of the schema they stand in."""
    defs: dict = {}
    call = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": _rooted(f["parameters"], f"f{i}_", defs),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for i, f in enumerate(functions)
    ]
    schema = {"type": "array", "items": call[0] if len(call) == 1 else {"anyOf": call}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _rooted(parameters, prefix: str, defs: dict):
    """parameters with its $defs / definitions moved into defs as prefix + name, and every local
    reference rewritten to point there (a reference into parameters itself: to defs[prefix + "root"])."""
    if not isinstance(parameters, dict):
        return parameters
    moved = ("$defs", "definitions")
    uses_root = False

    def ref(pointer: str) -> str:
        nonlocal uses_root
        for table in moved:
            head = f"#/{table}/"
            if pointer.startswith(head):
                return f"#/$defs/{prefix}{pointer[len(head) :]}"
        uses_root = True
        return f"#/$defs/{prefix}root{pointer[1:]}"

    def rewrite(node):
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        if not isinstance(node, dict):
            return node
        return {
            key: ref(value)
            if key == "$ref" and isinstance(value, str) and value.startswith("#")
            else rewrite(value)
            for key, value in node.items()
        }

    body = rewrite({k: v for k, v in parameters.items() if k not in moved})
    for table in moved:
        for name, schema in (parameters.get(table) or {}).items():
            defs[prefix + name] = rewrite(schema)
    if uses_root:
        defs[prefix + "root"] = body
    return body


def choice_for(tools, tool_choice, parallel: bool) -> ToolChoice | None:
    """The ToolChoice of a request's tools / tool_choice (schemas.py models), None when no tool may
    be called. Raises ValueError naming the problem (a named function that is not among tools), or
    RequestError for a forced function's parameters that constrained decoding would not enforce."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError("'tool_choice' asks for a tool call but the request has no 'tools'")
        return None
    if tool_choice == "none":
        return None
    functions = [_function(t) for t in tools]
    if tool_choice is None or tool_choice == "auto":
        return ToolChoice(functions, "auto", parallel, None)
    if tool_choice == "required":
        mode, forced = "required", functions
    else:
        name = tool_choice.function.name
        forced = [f for f in functions if f["name"] == name]
        if not forced:
            raise ValueError(f"'tool_choice' names function {name!r}, which is not among 'tools'")
        mode = "named"
    for i, f in enumerate(functions):
        if f in forced:
            check_json_schema(f["parameters"], "tools", where=f"tools[{i}].function.parameters")
    grammar = Grammar("json_schema", json.dumps(calls_schema(forced, parallel)), source="tools")
    return ToolChoice(functions, mode, parallel, grammar)


def add_to_system_message(messages: list[dict], choice: ToolChoice) -> None:
    """Shows the functions in the system message (the first message, added if there is none, so
    templates that allow one system message at the start still apply)."""
    listing = json.dumps(choice.functions, ensure_ascii=False)
    text = (
        "You can call these functions. To call them, reply with only a JSON array of "
        f'{{"name": ..., "arguments": {{...}}}} objects.\nFunctions: {listing}'
    )
    if messages and messages[0]["role"] == "system":
        messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}
    else:
        messages.insert(0, {"role": "system", "content": text})


def message_for_template(m) -> dict:
    """A request message (schemas.ChatMessage) as {"role", "content": str} for a chat template:
    developer -> system, assistant tool calls as their JSON array, tool results as user text."""
    if m.content is None:
        text = ""
    elif isinstance(m.content, str):
        text = m.content
    else:
        text = "".join(part.text for part in m.content)
    if m.role == "tool":
        return {"role": "user", "content": f"Result of tool call {m.tool_call_id or ''}: {text}"}
    if m.role == "assistant" and m.tool_calls:
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls]
        text = (text + "\n" if text else "") + json.dumps(calls, ensure_ascii=False)
    return {"role": "system" if m.role == "developer" else m.role, "content": text}


def parse(text: str, choice: ToolChoice) -> list[dict] | None:
    """OpenAI tool_calls from the model's output, or None when it is not a call of known functions."""
    body = text.strip()
    if body.startswith("<tool_call>") and body.endswith("</tool_call>"):
        body = body[len("<tool_call>") : -len("</tool_call>")].strip()
    try:
        calls = json.loads(body, strict=False)  # raw control characters in strings: re-escaped below
    except json.JSONDecodeError:
        return None
    calls = [calls] if isinstance(calls, dict) else calls
    names = {f["name"] for f in choice.functions}
    if not isinstance(calls, list) or not calls:
        return None
    if not all(
        isinstance(c, dict) and c.get("name") in names and isinstance(c.get("arguments"), dict) for c in calls
    ):
        return None
    return [
        {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
        }
        for c in calls
    ]
