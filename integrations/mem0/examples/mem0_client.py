"""Mem0's own Python client (``mem0.MemoryClient``) against ``inferscale serve``: change
``host`` and nothing else.

``MemoryClient`` speaks Mem0's Platform API; ``inferscale serve`` answers it (docs/server.md,
"Mem0's own client"), so code written for Mem0 keeps its calls and gains injected KV. This
script runs in an environment with only ``mem0ai`` (``client-requirements.txt``;
``scripts/install.sh`` makes one in ``.venv-mem0-client``) and makes every memory call
Mem0's client has, scoped to one user:

1. ``MemoryClient(api_key, host)`` (its constructor pings the server with the key);
2. ``add`` (``infer=False``: each message is a memory as written), ``get_all``, ``search``,
   ``get``, ``update``, ``history``, ``users``;
3. a chat through the server's OpenAI API (the ``openai`` package ``mem0ai`` already
   installs) as that user: the memories come as injected KV, and the answer uses them;
4. ``delete``, ``delete_all``, ``delete_users``.

    MEM0_TELEMETRY=False .venv-mem0-client/bin/python integrations/mem0/examples/mem0_client.py \\
        --base-url http://127.0.0.1:8000 --api-key "$INFERSCALE_API_KEY" --user alice

(``MEM0_TELEMETRY=False`` keeps Mem0's client from reporting usage to PostHog.) ``--json``
prints one JSON object of what each call returned (what the tests check). Exit status 1
with the server's message when a call fails.
"""

from __future__ import annotations

import argparse
import json
import sys

import openai
from mem0 import MemoryClient


def run(base_url: str, api_key: str, user: str) -> dict:
    """Every call above; returns what each gave back."""
    client = MemoryClient(api_key=api_key, host=base_url)  # GET /v1/ping/ with 'Authorization: Token <key>'
    out: dict = {"project_id": client.project_id}
    facts = ["My cat is called Miso.", "I work as a lighthouse keeper."]
    out["add"] = client.add([{"role": "user", "content": f} for f in facts], user_id=user, infer=False,
                            metadata={"source": "onboarding"})  # results: what was new (a rerun adds nothing)
    out["get_all"] = client.get_all(filters={"user_id": user})
    by_text = {m["memory"]: m["id"] for m in out["get_all"]["results"]}
    ids = [by_text[f] for f in facts]
    out["search"] = client.search("What is my cat called?", filters={"user_id": user}, top_k=1)
    out["get"] = client.get(ids[1])
    out["update"] = client.update(ids[1], text="I work as a ferry captain.")
    out["history"] = client.history(ids[1])
    out["users"] = client.users()

    # the same memories, as KV: a chat through the server's OpenAI API as this user
    llm = openai.OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key, max_retries=0)
    resp = llm.chat.completions.create(
        model=llm.models.list().data[0].id, messages=[{"role": "user", "content": "What is my cat called?"}],
        user=user, max_tokens=16, temperature=0, extra_body={"memory": {"wait_for_kv": True}})
    out["chat"] = {"text": resp.choices[0].message.content, "memory": (resp.model_extra or {}).get("memory", {})}

    out["delete"] = client.delete(ids[1])
    out["get_all_after_delete"] = client.get_all(filters={"user_id": user})
    out["delete_all"] = client.delete_all(filters={"user_id": user})
    client.add("I like green tea.", user_id=user, infer=False)
    out["delete_users"] = client.delete_users(user_id=user)
    out["get_all_at_end"] = client.get_all(filters={"user_id": user})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", required=True, help="the server's INFERSCALE_API_KEY")
    parser.add_argument("--user", default="alice")
    parser.add_argument("--json", action="store_true", help="print one JSON object of every call's answer")
    a = parser.parse_args()
    try:
        out = run(a.base_url, a.api_key, a.user)
    except Exception as exc:  # Mem0's client raises its own errors, carrying the server's message
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(out))
        return 0
    print("memories:", [m["memory"] for m in out["get_all"]["results"]])
    print("search:", [(h["memory"], round(h["score"], 3)) for h in out["search"]["results"]])
    print("chat:", out["chat"]["text"], f"({out['chat']['memory'].get('kv_tokens', 0)} prompt tokens as KV)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
