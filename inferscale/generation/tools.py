"""Tool calling for any chat model: tools described in the system turn, forced calls by
constrained decoding, calls parsed from the answer.

Tools are given in OpenAI's function format (what LangChain's ``convert_to_openai_tool``
and LlamaIndex's ``ToolMetadata.to_openai_tool`` produce)::

    {"type": "function", "function": {"name": ..., "description": ..., "parameters": <JSON Schema>}}

The model is told about them in the system turn, after the memory block (so the memory
block's KV is unchanged), in the Hermes / Qwen convention that many open chat models are
trained on: a ``<tools>`` list, and a call written as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

``tool_choice``:
    * ``None`` / ``"auto"``: the model decides; a call is parsed from its text when it
      wrote one (how often it does depends on the model).
    * ``"required"`` / ``"any"`` / a tool's name / ``{"type": "function", "function":
      {"name": ...}}``: the answer is constrained by vLLM's structured outputs to one
      ``{"name", "arguments"}`` object valid for the tool's schema, so any model calls it.
    * ``"none"``: the tools are not offered.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FORCED = ("required", "any")


@dataclass(frozen=True)
class ToolCall:
    """A tool call parsed from an answer.

    Attributes:
        id: a new id (``"call_"`` and 24 hex digits), for the tool result to refer to.
        name: the tool's name.
        arguments: the call's arguments (a JSON object).
    """

    id: str
    name: str
    arguments: dict

    def to_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


def check_tools(tools: Any) -> list[dict] | None:
    """Validate tools in OpenAI's function format; returns them as a list (``None`` for none).

    Raises:
        TypeError: ``tools`` is not a list of dicts.
        ValueError: a tool without ``function.name``, a duplicate name, or parameters that
            are not a JSON Schema object.
    """
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Sequence):
        raise TypeError(f"tools must be a list of OpenAI-format tool dicts, got {type(tools).__name__}")
    names = set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("function"), dict):
            raise TypeError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', 'description', "
                            f"'parameters'}}}}, got {t!r:.200}")
        name = t["function"].get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        if name in names:
            raise ValueError(f"tools[{i}]: two tools are named {name!r}; tool names must be unique")
        names.add(name)
        params = t["function"].get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError(f"tools[{i}] ({name}): parameters must be a JSON Schema of type 'object', got {params!r:.200}")
        try:
            json.dumps(t)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"tools[{i}] ({name}) is not JSON: {exc} (e.g. a date default: give it as a string)") from None
    return list(tools)


def chosen_tool(tools: Sequence[dict] | None, tool_choice: Any) -> str | None:
    """The forced tool's name, ``"*"`` when any tool must be called, ``None`` when the model
    decides (or no tools).

    Raises:
        ValueError: a ``tool_choice`` that is not one of the accepted values, names no
            given tool, or forces a call with no tools.
    """
    if tool_choice in (None, "auto", "none"):
        return None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise ValueError(f"tool_choice {tool_choice!r} is not {{'type': 'function', 'function': {{'name': ...}}}}")
        tool_choice = name
    if not isinstance(tool_choice, str):
        raise TypeError(f"tool_choice must be 'auto', 'none', 'required', 'any', a tool name or an OpenAI "
                        f"tool_choice dict, got {tool_choice!r}")
    if not tools:
        raise ValueError(f"tool_choice={tool_choice!r} forces a tool call, but no tools were given")
    if tool_choice in _FORCED:
        return "*"
    names = [t["function"]["name"] for t in tools]
    if tool_choice not in names:
        hint = (f" (did you mean {tool_choice.lower()!r}?)"
                if tool_choice.lower() in ("auto", "none", *_FORCED) else "")
        raise ValueError(f"tool_choice={tool_choice!r} names no given tool{hint}; the tools are {names}")
    return tool_choice


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def call_schema(tools: Sequence[dict], chosen: str) -> dict:
    """The JSON Schema a forced call is decoded under: ``{"name": <const>, "arguments": <the
    tool's parameters>}``, one alternative per allowed tool (``chosen`` is a name or ``"*"``).

    The parameters' own definitions (``$defs`` / ``definitions``, which pydantic writes for
    nested models and ``#/$defs/...`` references point at) move to the root, where those
    references resolve.

    Raises:
        ValueError: two allowed tools define the same name differently.
    """
    allowed = [t for t in tools if chosen == "*" or t["function"]["name"] == chosen]
    defs: dict[str, dict[str, Any]] = {}
    alternatives = []
    for t in allowed:
        params = dict(_parameters(t))
        for key in ("$defs", "definitions"):
            for name, spec in (params.pop(key, None) or {}).items():
                if defs.setdefault(key, {}).setdefault(name, spec) != spec:
                    raise ValueError(f"tools define {key}[{name!r}] differently ({t['function']['name']} and another): "
                                     "rename one, or force one tool with tool_choice=<name>")
        alternatives.append({"type": "object",
                             "properties": {"name": {"const": t["function"]["name"]}, "arguments": params},
                             "required": ["name", "arguments"], "additionalProperties": False})
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    return {**schema, **defs}


def tool_instructions(tools: Sequence[dict]) -> str:
    """System text describing ``tools`` and how to call them (Hermes format)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to answer the user. The functions are listed in <tools></tools>:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call a function, answer with only a JSON object with the function's name and arguments in "
            '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>\nOtherwise, answer the user in plain text.")


def render_tool_calls(calls: Sequence[dict]) -> str:
    """An assistant's earlier tool calls (``{"name", "arguments"}`` dicts) as its message text,
    in the format :func:`tool_instructions` asks for."""
    return "\n".join(f"<tool_call>\n{json.dumps({'name': c['name'], 'arguments': c.get('arguments') or {}}, ensure_ascii=False)}"
                     "\n</tool_call>" for c in calls)


def parse_tool_calls(text: str, tools: Sequence[dict]) -> list[ToolCall]:
    """The calls of given tools in an answer: the whole answer as one ``{"name", "arguments"}``
    object (a forced call), or ``<tool_call>`` blocks; anything else is no call.

    Objects that are not valid JSON or name no given tool are ignored (the answer stays text).
    """
    names = {t["function"]["name"] for t in tools}
    stripped = text.strip()
    candidates = [stripped] if stripped.startswith("{") else _CALL.findall(text)
    calls = []
    for raw in candidates:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in names:
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                continue
        if isinstance(args, dict):
            calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], args))
    return calls
