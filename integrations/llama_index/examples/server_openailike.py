"""LlamaIndex's ``OpenAILike`` against ``inferscale serve``: memory over HTTP, no InferScale
import in the client.

An agent's own environment often cannot hold the serving stack (vLLM pins its own
``openai``, ``transformers`` and ``setuptools``), and need not: the server speaks the
OpenAI API. This script runs in an environment with only
``llama-index-llms-openai-like`` (see ``server-client-requirements.txt``; ``scripts/install.sh``
makes one in ``.venv-llamaindex-client``) and talks to a running ``inferscale serve``:

1. session 1: stores what the user said as a memory (``POST /memories``, Mem0's route);
2. session 2: a new ``OpenAILike`` with no chat history asks about it; the scope is the
   OpenAI ``user`` field (``additional_kwargs={"user": ...}``) and InferScale's options go in
   ``extra_body={"memory": {...}}``; the server retrieves the user's memories and injects
   their KV. The response's ``raw`` keeps the server's ``memory`` report (which memories, how
   many prompt tokens came as KV);
3. the same question streamed (``stream_chat``): the first chunk carries the report;
4. a forced tool call (``chat_with_tools(..., tool_required=True)``), parsed by vLLM's
   tool-call parser, and ``structured_predict`` into a pydantic model.

    .venv-llamaindex-client/bin/python integrations/llama_index/examples/server_openailike.py \\
        --base-url http://127.0.0.1:8000 --api-key "$INFERSCALE_API_KEY" --user alice

``--json`` prints one JSON object of what each step returned (what the tests check)
instead of the readable lines. Exit status 1 with a message when the server cannot be
reached or answers with an error.
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx
import openai
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike
from pydantic import BaseModel, Field


class Allergy(BaseModel):
    """A food the user must avoid."""

    food: str = Field(description="the food, one word")


def record_allergy(food: str) -> str:
    """Record a food the user must avoid."""
    return f"noted: no {food}"


def memory_report(raw) -> dict:
    """The server's ``memory`` report from an ``openai`` response or chunk (``{}`` when absent)."""
    extra = getattr(raw, "model_extra", None) or {}
    return extra.get("memory") or {}


def server_url(base_url: str) -> str:
    """The server's root from what a user may pass: a trailing ``/`` or ``/v1`` (the form
    OpenAI clients take) is dropped, so ``/memories`` and ``/v1/...`` both resolve."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def error_text(exc: Exception) -> str:
    """One line saying what went wrong: the server's own message for an HTTP error."""
    response = getattr(exc, "response", None)
    if response is not None:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:300]
        return f"{response.status_code} from {response.request.url}: {message}"
    return f"{type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="inferscale serve's address")
    parser.add_argument("--api-key", default="", help="the server's API key (leave out when it has none)")
    parser.add_argument("--user", default="alice", help="whose memory (the OpenAI 'user' field)")
    parser.add_argument("--fact", default="I am allergic to peanuts.", help="what the user says in session 1")
    parser.add_argument("--wait-for-kv", action="store_true",
                        help="let session 2 wait for the fact's KV (a session a day later finds it encoded; "
                             "without this, a fact added a moment ago is answered from as text)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = parser.parse_args(argv)
    base = server_url(args.base_url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    out: dict = {}
    try:
        # session 1: the agent stores what the user said (as it would after every turn)
        r = httpx.post(f"{base}/memories", headers=headers, timeout=300,
                       json={"messages": [{"role": "user", "content": args.fact}], "user_id": args.user})
        r.raise_for_status()
        out["added_ids"] = [e["id"] for e in r.json()["results"]]
        models = httpx.get(f"{base}/v1/models", headers=headers, timeout=60)
        models.raise_for_status()
        model = models.json()["data"][0]["id"]

        # session 2: a new LLM object, no chat history; the memory comes from the server
        llm = OpenAILike(model=model, api_base=f"{base}/v1", api_key=args.api_key or "none", is_chat_model=True,
                         is_function_calling_model=True, context_window=8192, temperature=0, max_tokens=24,
                         max_retries=0, timeout=300,
                         additional_kwargs={"user": args.user,
                                            "extra_body": {"memory": {"k": 10, "wait_for_kv": args.wait_for_kv}}})
        question = [ChatMessage(role="user", content="Which food am I allergic to?")]
        answer = llm.chat(question)
        out["chat"] = {"text": answer.message.content, "memory": memory_report(answer.raw)}

        chunks = list(llm.stream_chat(question))
        out["stream"] = {"text": chunks[-1].message.content if chunks else "", "chunks": len(chunks),
                         "memory": memory_report(chunks[0].raw) if chunks else {}}

        tooled = llm.model_copy(update={"max_tokens": 200})  # room for the whole tool-call envelope
        tool = FunctionTool.from_defaults(fn=record_allergy)
        response = tooled.chat_with_tools([tool], user_msg="Record the food I am allergic to.", tool_required=True)
        calls = tooled.get_tool_calls_from_response(response, error_on_no_tool_call=False)
        out["tool_calls"] = [{"name": c.tool_name, "kwargs": c.tool_kwargs} for c in calls]

        parsed = tooled.structured_predict(Allergy, PromptTemplate("Which food am I allergic to?"))
        out["structured"] = parsed.model_dump()
    except httpx.ConnectError as exc:
        print(f"server_openailike: nothing answers at {base} ({exc}): is `inferscale serve` running there?",
              file=sys.stderr)
        return 1
    except (httpx.HTTPError, openai.APIError, ValueError) as exc:
        print(f"server_openailike: {error_text(exc)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out))
    else:
        print(f"stored {out['added_ids']} for {args.user}")
        report = out["chat"]["memory"]
        print(f"chat: {out['chat']['text']!r} (memories as KV {report.get('kv_memory_ids')}, as text "
              f"{report.get('text_memory_ids')}; {report.get('kv_tokens')} prompt tokens as KV: the preamble "
              "and the memories that have KV)")
        print(f"stream: {out['stream']['text']!r} in {out['stream']['chunks']} chunks")
        print(f"tool calls: {out['tool_calls']}")
        print(f"structured: {out['structured']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
