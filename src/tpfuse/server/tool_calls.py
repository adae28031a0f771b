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
    """JSON schema of a non-empty array of calls to functions (at most one unless parallel)."""
    call = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = {"type": "array", "items": call[0] if len(call) == 1 else {"anyOf": call}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def choice_for(tools, tool_choice, parallel: bool) -> ToolChoice | None:
    """The ToolChoice of a request's tools / tool_choice (schemas.py models), None when no tool may
    be called. Raises ValueError naming the problem (a named function that is not among tools)."""
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
    return ToolChoice(
        functions, mode, parallel, Grammar("json_schema", json.dumps(calls_schema(forced, parallel)))
    )


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
