"""The documentation site builds with warnings as errors, and its API reference covers
the public classes of the core and of both adapters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_docs_site_builds_strict_with_the_api_reference(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], check=False,
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    for page in ("quickstart", "concepts", "adapters", "configuration", "server", "deployment", "benchmarks",
                 "architecture", "decisions"):
        assert (site / page / "index.html").is_file(), page
    api = (site / "api" / "index.html").read_text()
    for name in ("inferscale.Memory", "inferscale.Memory.generate", "inferscale.Memory.stream",
                 "inferscale.AsyncMemory",
                 "inferscale.types.Generation", "inferscale.types.GenerationChunk", "inferscale.sessions.ChatSessions",
                 "langchain_inferscale.ChatInferScale", "langchain_inferscale.InferScaleChatMessageHistory",
                 "langchain_inferscale.InferScaleRetriever", "langchain_inferscale.InferScaleStore",
                 "llama_index.llms.inferscale.InferScaleLLM",
                 "llama_index.storage.chat_store.inferscale.InferScaleChatStore",
                 "llama_index.memory.inferscale.InferScaleMemoryBlock", "inferscale.server.chat.MemoryOptions"):
        assert f'id="{name}"' in api, f"{name} missing from the API reference"
    assert "allow_unknown_scope" in api  # parameters come from the docstrings
    assert "img/kv-injection.svg" in (site / "concepts" / "index.html").read_text()  # the diagram
