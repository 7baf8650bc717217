"""Tool calling and structured output in the core (``inferscale.generation.tools``, ``Memory.generate``
with ``tools`` / ``tool_choice`` / ``json_schema`` / ``followup``), on the real engine."""

from __future__ import annotations

import json
import uuid

import pytest

from inferscale import GenerationOptions, Memory
from inferscale.generation.request import check_history
from inferscale.generation.tools import call_schema, check_tools, chosen_tool, parse_tool_calls, render_tool_calls


def _tool(name: str, properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"The {name} tool.", "parameters": {
        "type": "object", "properties": properties, "required": required or list(properties)}}}


WEATHER = _tool("get_weather", {"city": {"type": "string"}})
ADD = _tool("add", {"a": {"type": "integer"}, "b": {"type": "integer"}})
TOOLS = [WEATHER, ADD]
JOKE = {"type": "object", "properties": {"setup": {"type": "string", "maxLength": 60},
                                         "punchline": {"type": "string", "maxLength": 60}},
        "required": ["setup", "punchline"], "additionalProperties": False}


# ---------------------------------------------------------------- without the engine

@pytest.mark.parametrize("tools, error", [
    ("get_weather", TypeError),
    ({"function": {"name": "f"}}, TypeError),
    ([{"name": "f"}], TypeError),
    ([_tool("has space", {})], ValueError),
    ([WEATHER, WEATHER], ValueError),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], ValueError),
])
def test_bad_tools_are_refused_naming_the_problem(tools, error):
    with pytest.raises(error, match="tools"):
        check_tools(tools)
    with pytest.raises(error, match="tools"):
        GenerationOptions(tools=tools)


@pytest.mark.parametrize("choice, expected", [
    (None, None), ("auto", None), ("none", None), ("required", "*"), ("any", "*"), ("add", "add"),
    ({"type": "function", "function": {"name": "add"}}, "add"),
])
def test_tool_choice_resolves_to_the_forced_tool(choice, expected):
    assert chosen_tool(TOOLS, choice) == expected
    assert GenerationOptions(tools=TOOLS, tool_choice=choice).forced_tool() == expected


@pytest.mark.parametrize("options, match", [
    (dict(tools=TOOLS, tool_choice="multiply"), "names no given tool"),
    (dict(tool_choice="required"), "no tools were given"),
    (dict(tools=TOOLS, tool_choice={"type": "function"}), "is not"),
    (dict(tools=TOOLS, tool_choice="add", json_schema=JOKE), "give one"),
])
def test_inconsistent_tool_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        GenerationOptions(**options)


def test_a_forced_call_schema_allows_exactly_the_chosen_tools():
    one = call_schema(TOOLS, "add")
    assert one["properties"]["name"] == {"const": "add"}
    assert one["properties"]["arguments"] == ADD["function"]["parameters"]
    both = call_schema(TOOLS, "*")
    assert [alt["properties"]["name"]["const"] for alt in both["anyOf"]] == ["get_weather", "add"]


def test_calls_are_parsed_from_a_forced_object_or_tool_call_blocks_and_nothing_else():
    (forced,) = parse_tool_calls('{"name": "add", "arguments": {"a": 1, "b": 2}}', TOOLS)
    assert (forced.name, forced.arguments) == ("add", {"a": 1, "b": 2}) and forced.id.startswith("call_")
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Lisbon"}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>')
    assert [(c.name, c.arguments) for c in parse_tool_calls(text, TOOLS)] == [
        ("get_weather", {"city": "Lisbon"}), ("add", {"a": 3, "b": 4})]
    for not_a_call in ("It is sunny.", '{"name": "unknown", "arguments": {}}', "<tool_call>{not json</tool_call>",
                       '{"name": "add", "arguments": [1, 2]}'):
        assert parse_tool_calls(not_a_call, TOOLS) == []
    assert parse_tool_calls(render_tool_calls([{"name": "add", "arguments": {"a": 1}}]), TOOLS)[0].arguments == {"a": 1}


def test_history_renders_tool_calls_and_results_and_refuses_bad_ones():
    messages = check_history([
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "content": "3"},
    ])
    assert messages[1] == {"role": "assistant", "content": render_tool_calls([{"name": "add", "arguments": {"a": 1, "b": 2}}])}
    assert messages[2] == {"role": "tool", "content": "3"}
    assert check_history([{"role": "tool", "content": ""}]) == ({"role": "tool", "content": ""},)  # a tool may return nothing
    for bad, error in (([{"role": "assistant", "tool_calls": "add"}], TypeError),
                       ([{"role": "assistant", "tool_calls": [{"name": "add", "arguments": "{oops"}]}], ValueError),
                       ([{"role": "assistant", "tool_calls": [{"name": "add", "arguments": {"when": {1, 2}}}]}],
                        TypeError),
                       ([{"role": "user", "content": "hi", "tool_calls": []}], ValueError),
                       ([{"role": "tool"}], TypeError),
                       ([{"role": "user", "content": ""}], ValueError),
                       ([{"role": "function", "content": "3"}], ValueError)):
        with pytest.raises(error, match="history message 0"):
            check_history(bad)


def test_nested_pydantic_parameters_keep_their_definitions_in_a_forced_call():
    params = {"type": "object", "properties": {"pet": {"$ref": "#/$defs/Pet"}, "owner": {"type": "string"}},
              "required": ["pet", "owner"], "$defs": {"Pet": {"type": "object", "properties": {
                  "name": {"type": "string"}}, "required": ["name"]}}}
    schema = call_schema([_tool("adopt", {}) | {"function": {"name": "adopt", "parameters": params}}], "adopt")
    assert schema["$defs"] == params["$defs"] and "$defs" not in schema["properties"]["arguments"]
    clash = {**params, "$defs": {"Pet": {"type": "string"}}}
    with pytest.raises(ValueError, match="differently"):
        call_schema([{"type": "function", "function": {"name": "a", "parameters": params}},
                     {"type": "function", "function": {"name": "b", "parameters": clash}}], "*")


def test_stop_strings_are_refused_with_a_constrained_answer():
    with pytest.raises(ValueError, match="drop stop"):
        GenerationOptions(tools=TOOLS, tool_choice="add", stop=["}"])
    with pytest.raises(ValueError, match="drop stop"):
        GenerationOptions(json_schema=JOKE, stop=["x"])
    with pytest.raises(TypeError, match="got True"):
        GenerationOptions().merged(tools=TOOLS, tool_choice=True)


# ---------------------------------------------------------------- on the engine

@pytest.fixture(scope="module")
def memory(serving_dir, engine):
    return Memory(data_dir=serving_dir, dtype="float32", engine=engine, max_model_len=4096)


@pytest.fixture(scope="module")
def user(memory) -> str:
    user = f"tools-{uuid.uuid4().hex[:8]}"
    memory.add_facts(["I live in Lisbon.", "My dog's name is Biscuit."], user_id=user)
    assert memory.wait_for_kv(timeout=600)
    return user


@pytest.mark.parametrize("choice", ["required", "get_weather", "add"])
def test_a_forced_call_is_valid_for_the_tool_schema_and_the_memory_is_still_injected(memory, user, choice):
    gen = memory.generate("What is the weather like where I live?", user_id=user, tools=TOOLS, tool_choice=choice,
                          max_tokens=48)
    (call,) = gen.tool_calls
    assert json.loads(gen.text) == {"name": call["name"], "arguments": call["arguments"]}  # the whole answer
    if choice != "required":
        assert call["name"] == choice
    spec = {"get_weather": WEATHER, "add": ADD}[call["name"]]["function"]["parameters"]
    assert set(call["arguments"]) == set(spec["required"])
    assert all(isinstance(v, str if spec["properties"][k]["type"] == "string" else int)
               for k, v in call["arguments"].items())
    expected = memory.inject("What is the weather like where I live?", user_id=user)
    # tools follow the memory block, whose KV is unchanged: it is injected (or, on a repeat,
    # found in vLLM's prefix cache where the first injection left it), never prefilled
    assert gen.num_prompt_tokens - gen.num_prefilled_tokens >= expected.memory_tokens
    assert sorted(gen.kv_memory_ids) == sorted(m["id"] for m in memory.get_all(user_id=user)["results"])


def test_json_schema_constrains_the_answer(memory, user):
    gen = memory.generate("Tell me a joke about my dog.", user_id=user, json_schema=JOKE, max_tokens=96)
    joke = json.loads(gen.text)
    assert set(joke) == {"setup", "punchline"} and all(isinstance(v, str) for v in joke.values())
    assert gen.tool_calls == [] and gen.finish_reason == "stop"
    cut = memory.generate("What is the weather like where I live?", user_id=user, tools=TOOLS, tool_choice="required",
                          max_tokens=4)
    assert cut.finish_reason == "length" and cut.tool_calls == []  # cut mid-object: no call, and it says why


@pytest.mark.parametrize("schema", [{"type": "bogus"}, {"type": "integer", "minimum": 5, "maximum": 1},
                                    {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}},
                                    {"type": "number", "multipleOf": 3}])
def test_a_schema_vllm_cannot_decode_is_refused_before_the_request(memory, user, schema):
    count = len(memory.get_all(user_id=user)["results"])
    with pytest.raises(ValueError, match="cannot be decoded by vLLM's structured outputs"):
        memory.stream("Hi", user_id=user, json_schema=schema)  # raised by the call, not the iterator
    assert len(memory.get_all(user_id=user)["results"]) == count
    assert memory.generate("Hi", user_id=user, max_tokens=2).text is not None  # and the memory still serves


def test_a_forced_call_of_a_tool_with_nested_models_decodes(memory, user):
    pet = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                            "species": {"type": "string", "maxLength": 20}},
           "required": ["name", "species"]}
    adopt = {"type": "function", "function": {"name": "adopt", "description": "Register a pet.", "parameters": {
        "type": "object", "properties": {"pet": {"$ref": "#/$defs/Pet"}, "owner": {"type": "string", "maxLength": 20}},
        "required": ["pet", "owner"], "$defs": {"Pet": pet}}}}
    gen = memory.generate("Register my dog.", user_id=user, tools=[adopt], tool_choice="adopt", max_tokens=64)
    (call,) = gen.tool_calls
    assert set(call["arguments"]) == {"pet", "owner"} and set(call["arguments"]["pet"]) == {"name", "species"}


def test_an_answer_after_tool_results_has_the_same_logprobs_injected_as_prefilled(memory):
    """Tools in the system turn, the call and its result after the question: the memory
    block's KV still stands for its tokens (inject == text mode at the first answer token;
    one memory, encoded after exactly the preamble that precedes it in the prompt)."""
    user = f"tools-one-{uuid.uuid4().hex[:8]}"
    memory.add_facts(["I live in Lisbon."], user_id=user)
    assert memory.wait_for_kv(timeout=600)
    followup = [{"role": "assistant", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Lisbon"}}]},
                {"role": "tool", "content": "It is sunny and 24 degrees in Lisbon today."}]
    args = dict(user_id=user, tools=TOOLS, followup=followup, max_tokens=1, logprobs=20)
    injected = memory.generate("What is the weather like where I live?", mode="inject", **args)
    prefilled = memory.generate("What is the weather like where I live?", mode="text", **args)
    memory_tokens = memory.inject("What is the weather like where I live?", user_id=user).memory_tokens
    assert injected.num_prompt_tokens - injected.num_prefilled_tokens >= memory_tokens
    assert prefilled.num_injected_tokens == 0
    assert injected.num_prompt_tokens == prefilled.num_prompt_tokens
    common = set(injected.first_logprobs) & set(prefilled.first_logprobs)
    assert len(common) >= 10
    assert max(abs(injected.first_logprobs[t] - prefilled.first_logprobs[t]) for t in common) < 1e-3


def test_tool_choice_none_withholds_the_tools(memory, user):
    offered = memory.prepare("Hi", user_id=user, tools=TOOLS, mode="text").prompt_token_ids
    withheld = memory.prepare("Hi", user_id=user, tools=TOOLS, tool_choice="none", mode="text").prompt_token_ids
    plain = memory.prepare("Hi", user_id=user, mode="text").prompt_token_ids
    assert withheld == plain and len(offered) > len(plain) + 40


def test_scope_given_inside_filters_as_mem0_does(memory, user):
    by_keyword = memory.search("where do I live", user_id=user)["results"]
    assert memory.search("where do I live", filters={"user_id": user})["results"] == by_keyword
    assert memory.get_all(filters={"user_id": user}) == memory.get_all(user_id=user)
    assert memory.search("where do I live", user_id=user, filters={"user_id": user})["results"] == by_keyword
    with pytest.raises(ValueError, match="disagree"):
        memory.search("where do I live", user_id=user, filters={"user_id": "someone-else"})
    with pytest.raises(ValueError, match="must be a non-empty string"):
        memory.get_all(filters={"user_id": {"in": [user]}})
    with pytest.raises(ValueError, match="one of user_id"):
        memory.search("where do I live", filters={"topic": "home"})
    with pytest.raises(ValueError, match="inside an AND"):
        memory.search("where do I live", user_id=user, filters={"AND": [{"user_id": "bob"}]})
