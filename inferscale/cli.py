"""``inferscale`` command line: ``demo``, ``serve``, ``mcp``, ``copy-to-chroma``, ``models prepare`` and ``bench``."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from inferscale.cli_bench import bench_app
from inferscale.cli_common import DTYPE_OPTION as _DTYPE, console, fail as _fail
from inferscale.config import AUTO_DTYPE_RULE

app = typer.Typer(add_completion=False, help="InferScale: LLM memory served as precomputed KV in vLLM.")
models_app = typer.Typer(help="Default model preparation.")
app.add_typer(models_app, name="models")
app.add_typer(bench_app, name="bench")


@app.callback()
def _quiet() -> None:
    """Keep the terminal for InferScale's own output (vLLM's engines are quieted by the library
    itself, :mod:`inferscale.runtime.logs`), no known deprecation noise."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # transformers is a dependency; this only guards odd installs
        pass


@models_app.command("prepare")
def models_prepare() -> None:
    """Convert / locate the default offline models (SmolLM2-135M-Instruct, all-MiniLM-L6-v2)."""
    from inferscale.config import DEFAULT_EMBEDDER
    from inferscale.models.resolve import prepare_smollm2, resolve_embedder

    from inferscale.models.embedding import Embedder

    console.print(f"LLM: {prepare_smollm2()}")
    embedder = Embedder(DEFAULT_EMBEDDER, "cpu")
    embedder.encode(["prepare"])  # exports the ONNX graph once (cached)
    console.print(f"embedder: {resolve_embedder(DEFAULT_EMBEDDER)} ({embedder.backend_in_use} backend on the CPU)")


@app.command()
def demo(
    data: Optional[Path] = typer.Option(None, help="locomo10.json (default: ../shared/data/locomo, else downloaded once)."),
    sample: int = typer.Option(0, help="Conversation sample index (0-9)."),
    questions: int = typer.Option(10, min=1, help="Questions to answer (categories 1-4, in file order)."),
    k: int = typer.Option(10, min=0, help="Facts retrieved per question."),
    context_window: int = typer.Option(5, min=0, help="w: turns before each fact's source turn encoded with it."),
    dtype: str = typer.Option("auto", help=f"auto ({AUTO_DTYPE_RULE}), float32 or bfloat16."),
    data_dir: Optional[Path] = typer.Option(None, help="Memory store (default: <data dir>/demo; data dir: $INFERSCALE_DATA_DIR or ~/.local/share/inferscale)."),
    record: Optional[Path] = typer.Option(None, help="Also write this run's transcript as a Markdown page (docs/results/demo.md)."),
) -> None:
    """Ingest a LoCoMo conversation, then answer questions with KV injection vs prompt text."""
    import shlex
    import sys

    from inferscale.datasets.locomo import LocomoFormatError
    from inferscale.demo import timed_demo, write_page
    from inferscale.models.resolve import ModelNotFoundError
    from inferscale.store.records import StoreError

    if dtype not in ("auto", "float32", "bfloat16"):
        _fail(f"--dtype must be auto, float32 or bfloat16, got {dtype!r}")
    if record is not None and record.is_dir():
        _fail(f"--record {record} is a folder: give the Markdown file to write, e.g. docs/results/demo.md")
    # a fixed width: the recorded table looks the same whatever the terminal (tests compare its shape)
    out = Console(soft_wrap=True, record=True, width=120) if record is not None else console
    try:
        _rows, wall_s = timed_demo(data=data, sample=sample, questions=questions, k=k, context_window=context_window,
                                   dtype=dtype, data_dir=data_dir, console=out)
    except (FileNotFoundError, LocomoFormatError, ModelNotFoundError, StoreError, ValueError) as exc:
        _fail(str(exc))
    out.print("Next, the benchmarks (README.md, section Benchmarks; `inferscale bench --help` lists them all): "
              "`inferscale bench latency`, `bench throughput`, `bench quality`, `bench retrieval`, `bench serve`; "
              "each writes JSON, Markdown and a PNG.")
    if record is not None:
        command = "inferscale " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        try:
            write_page(record, out.export_text(), command, wall_s)
        except OSError as exc:
            _fail(f"cannot write --record {record}: {exc}")
        console.print(f"transcript written to {record}")


def _store_config(data_dir: Optional[Path], chroma_url: Optional[str], **more):
    """The settings of a command on a store (``--data-dir``, ``--chroma-url`` and ``more``),
    or exit 2 with one line: a bad value, or a data dir that is a file."""
    from inferscale.config import MemoryConfig

    overrides = {k: v for k, v in {"data_dir": data_dir, "chroma_url": chroma_url, **more}.items() if v is not None}
    try:
        config = MemoryConfig(**overrides)
    except (TypeError, ValueError) as exc:
        _fail(str(exc))
    if config.data_dir.exists() and not config.data_dir.is_dir():
        _fail(f"--data-dir {config.data_dir} is a file: give the data dir (a folder)")
    return config


@app.command("reembed")
def reembed_command(
    embedder: str = typer.Option(..., help="The new embedder: a sentence-transformers folder, a hub id, or pypi:<package>."),
    data_dir: Optional[Path] = typer.Option(None, help="The data dir (default: $INFERSCALE_DATA_DIR or ~/.local/share/inferscale)."),
    chroma_url: Optional[str] = typer.Option(None, help="The Chroma server holding the memories (default $INFERSCALE_CHROMA_URL; none: the data dir's embedded store)."),
) -> None:
    """Embed every memory again with another embedder, so the store opens with embedder=<it>.
    Ids, texts, metadata, history, turns and KV stay; the store is refused while it runs, and a
    re-embed that stops is finished by running it again."""
    from inferscale.models.embedding import Embedder
    from inferscale.models.resolve import ModelNotFoundError, resolve_embedder
    from inferscale.checks import first_line
    from inferscale.store.chroma import reembed_command
    from inferscale.store.reembed import reembed
    from inferscale.store.records import StoreError

    config = _store_config(data_dir, chroma_url, embedder=embedder)
    if config.chroma_url is None and not (config.data_dir / "chroma").is_dir():
        _fail(f"{config.data_dir} has no memory store ({config.data_dir / 'chroma'}): nothing to re-embed")
    try:
        model = Embedder(config.embedder, "cpu", source=resolve_embedder(config.embedder),
                         backend=config.embedder_backend)
        count = reembed(config.data_dir, config.chroma_server(), config.embedder,
                        lambda texts: model.encode(texts).numpy())
    except (StoreError, ModelNotFoundError) as exc:
        _fail(first_line(exc))
    except KeyboardInterrupt:
        _fail(f"stopped: the store is refused until `{reembed_command(embedder, config.data_dir, config.chroma_server())}`"
              " runs to its end")
    if count == 0:
        console.print(f"nothing to re-embed: the memories of {config.chroma_url or config.data_dir} (if any) use "
                      f"{embedder}; open the store with embedder={embedder!r}")
        return
    console.print(f"re-embedded {count} memories with {embedder}: open the store with embedder={embedder!r} "
                  f"(INFERSCALE_EMBEDDER={embedder})")


@app.command("copy-to-chroma")
def copy_to_chroma(
    chroma_url: Optional[str] = typer.Option(None, help="The Chroma server (http://host:port; default $INFERSCALE_CHROMA_URL)."),
    data_dir: Optional[Path] = typer.Option(None, help="The data dir whose embedded store to copy (default: $INFERSCALE_DATA_DIR or ~/.local/share/inferscale)."),
) -> None:
    """Move a data dir's memories from its embedded Chroma store to a Chroma server (ids, texts,
    embeddings, metadata; the history, turns and KV stay where they are); the embedded folder is
    kept as chroma.copied-<time>. Chroma's settings (tenant, database, collection, auth) are
    INFERSCALE_CHROMA_*'s."""
    from inferscale.config import MemoryConfig
    from inferscale.store.embedded import copy_to_server, embedded_path
    from inferscale.store.records import StoreError

    config = _store_config(data_dir, chroma_url)
    if config.chroma_url is None:
        _fail("give the Chroma server: --chroma-url http://host:port (or set INFERSCALE_CHROMA_URL)")
    if not embedded_path(config.data_dir).is_dir():
        backups = sorted(config.data_dir.glob("chroma.copied-*"))
        _fail(f"{config.data_dir} has no embedded Chroma store ({embedded_path(config.data_dir)}): nothing to copy"
              + (f" (copied before: the old store is kept as {backups[-1]})" if backups else ""))
    try:
        copied, held, backup = copy_to_server(config.data_dir, config.chroma_server())
    except StoreError as exc:
        _fail(str(exc))
    if backup is None:
        console.print(f"the embedded store of {config.data_dir} holds no memories: nothing to copy")
        return
    console.print(f"copied {copied} memories to {config.chroma_url} (collection {config.chroma_collection}"
                  + (f"; {held} were there already" if held else "") + f"); the embedded store is kept as {backup}. "
                  f"Open the data dir with chroma_url={config.chroma_url}"
                  + (f" and chroma_collection={config.chroma_collection}"
                     if config.chroma_collection != MemoryConfig.model_fields["chroma_collection"].default else "") + ".")


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (loopback by default; 0.0.0.0 for every interface)."),
    port: int = typer.Option(8000, min=1, max=65535, help="Port of InferScale's HTTP API."),
    data_dir: Optional[Path] = typer.Option(None, help="Memory store (default: $INFERSCALE_DATA_DIR or ~/.local/share/inferscale)."),
    vllm_url: Optional[List[str]] = typer.Option(None, help="Front a vLLM OpenAI server already running (docs/server.md) instead of starting one; repeat for replicas (vLLM's router is started in front of them)."),
    router_url: Optional[str] = typer.Option(None, help="Send every vLLM request to a vLLM router you run (vllm-router --policy consistent_hash; docs/deployment.md); --vllm-url then names its replicas for /ready and /metrics."),
    replicas: int = typer.Option(1, min=1, max=64, help="vLLM servers to start, with vLLM's router in front of them (each user is routed to one replica while it lives)."),
    workers: int = typer.Option(1, min=1, max=64, help="Front processes on the port; more than 1 needs INFERSCALE_CHROMA_URL (docs/deployment.md)."),
    api_key: Optional[str] = typer.Option(None, envvar="INFERSCALE_API_KEY", help="Require 'Authorization: Bearer <key>' (or Mem0's 'Token <key>') on every route but /health and /ready (or set INFERSCALE_API_KEY)."),
    served_model_name: Optional[str] = typer.Option(None, help="The 'model' name clients send (default: the model's)."),
    dtype: str = _DTYPE,
    kv_storage_dtype: Optional[str] = typer.Option(None, help="How fact KV is stored: auto (the model's dtype), int8 or int4 (default auto, or $INFERSCALE_KV_STORAGE_DTYPE; docs/configuration.md)."),
    disk_kv_budget_bytes: Optional[int] = typer.Option(None, help="Bytes of fact KV files kept on disk, at least 1 MiB; past it the least used are evicted and served as text until encoded again (default: no limit, or $INFERSCALE_DISK_KV_BUDGET_BYTES; docs/concepts.md)."),
    kv_redis_url: Optional[str] = typer.Option(None, help="A Redis shared by every deployment as a KV tier, e.g. redis://host:6379/0 (default: none, or $INFERSCALE_KV_REDIS_URL; docs/deployment.md)."),
    kv_admission_window_s: Optional[float] = typer.Option(None, min=0, help="While the disk budget is nearly full, keep a miss as KV only on its second use within this many seconds (default 86400, or $INFERSCALE_KV_ADMISSION_WINDOW_S; 0: keep every miss; docs/configuration.md)."),
    max_num_seqs: int = typer.Option(64, min=1, help="Most requests vLLM batches at once."),
    tool_call_parser: str = typer.Option("hermes", help="vLLM's tool-call parser for the model's tool-call format ('none': tools refused)."),
    default_max_tokens: Optional[int] = typer.Option(None, min=1, help="Answer budget (tokens) of a chat that sends no max_tokens (default 256, or $INFERSCALE_DEFAULT_MAX_TOKENS)."),
    max_body_bytes: int = typer.Option(16 << 20, min=1, envvar="INFERSCALE_MAX_BODY_BYTES", help="Largest request body, in bytes (larger: 413)."),
    max_header_bytes: int = typer.Option(64 << 10, min=1, envvar="INFERSCALE_MAX_HEADER_BYTES", help="Largest request head (request line and headers), in bytes (larger: 431)."),
    header_timeout_s: float = typer.Option(10.0, min=0.001, envvar="INFERSCALE_HEADER_TIMEOUT_S", help="Most seconds a request head may take to arrive (slower: 408)."),
    body_timeout_s: float = typer.Option(30.0, min=0.001, envvar="INFERSCALE_BODY_TIMEOUT_S", help="Most seconds a request body may take to arrive after its head (slower: 408)."),
) -> None:
    """Serve memory over HTTP: chat with memory on vLLM's OpenAI server, and Mem0-style memory routes."""
    from inferscale.config import MemoryConfig
    from inferscale.models.resolve import ModelNotFoundError
    from inferscale.server.limits import FrontLimits
    from inferscale.server.main import ServeOptions
    from inferscale.server.main import serve as run_server
    from inferscale.store.records import StoreError

    overrides: dict = {} if dtype == "auto" else {"dtype": dtype}  # INFERSCALE_DTYPE applies otherwise
    if data_dir is not None:
        if data_dir.exists() and not data_dir.is_dir():
            _fail(f"--data-dir {data_dir} is a file: give a folder (created when missing)")
        overrides["data_dir"] = data_dir
    if default_max_tokens is not None:
        overrides["default_max_tokens"] = default_max_tokens
    if kv_storage_dtype is not None:
        if kv_storage_dtype not in ("auto", "int8", "int4"):
            _fail(f"--kv-storage-dtype must be auto, int8 or int4, got {kv_storage_dtype!r}")
        overrides["kv_storage_dtype"] = kv_storage_dtype
    if kv_redis_url is not None:
        overrides["kv_redis_url"] = kv_redis_url
    if disk_kv_budget_bytes is not None:
        overrides["disk_kv_budget_bytes"] = disk_kv_budget_bytes
    if kv_admission_window_s is not None:
        overrides["kv_admission_window_s"] = kv_admission_window_s
    try:
        config = MemoryConfig(**overrides)
    except (TypeError, ValueError) as exc:  # name the flag the value came from, not the Python keyword
        message = str(exc)
        for field in overrides:
            message = message.replace(f"(the {field}= setting; its environment variable is INFERSCALE_{field.upper()})",
                                      f"(--{field.replace('_', '-')})")
        _fail(message)
    try:
        run_server(config, ServeOptions(host=host, port=port, vllm_urls=tuple(vllm_url or ()), router_url=router_url,
                                        replicas=replicas,
                                        workers=workers, api_key=api_key or None,
                                        served_model_name=served_model_name, max_num_seqs=max_num_seqs,
                                        tool_call_parser=None if tool_call_parser == "none" else tool_call_parser,
                                        limits=FrontLimits(max_body_bytes, max_header_bytes, header_timeout_s,
                                                           body_timeout_s)),
                   say=console.print)
    except (OSError, ModelNotFoundError, StoreError, RuntimeError, ValueError) as exc:  # VLLMStartError is a RuntimeError
        _fail(str(exc))


@app.command("mcp")
def mcp_stdio(
    data_dir: Optional[Path] = typer.Option(None, help="Memory store (default: $INFERSCALE_DATA_DIR or ~/.local/share/inferscale)."),
) -> None:
    """Serve memory to an MCP client over stdio (Claude Desktop, Cursor, agent SDKs): tools add, search,
    get_all, update, delete and answer. Settings from INFERSCALE_*; stdout carries MCP's JSON-RPC only,
    logs go to stderr (docs/adapters.md)."""
    import contextlib
    import logging
    import sys

    from inferscale.config import MemoryConfig
    from inferscale.mcp_server.app import run_stdio
    from inferscale.mcp_server.tools import MemoryTools
    from inferscale.memory import Memory
    from inferscale.models.resolve import ModelNotFoundError
    from inferscale.store import serve_lock
    from inferscale.store.records import StoreError

    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="inferscale mcp: %(levelname)s %(message)s")
    overrides: dict = {}
    if data_dir is not None:
        if data_dir.exists() and not data_dir.is_dir():
            _fail(f"--data-dir {data_dir} is a file: give a folder (created when missing)")
        overrides["data_dir"] = data_dir
    try:
        config = MemoryConfig(**overrides)
    except (TypeError, ValueError) as exc:
        _fail(str(exc))
    lock = None
    if config.chroma_url is None:  # an embedded store has one process writing it
        try:
            lock = serve_lock.hold(config.data_dir, "inferscale mcp")
        except serve_lock.DataDirServed as exc:
            where = ("that server's /mcp endpoint (docs/server.md)" if exc.command == "inferscale serve"
                     else "that process instead")
            _fail(f"another {exc.command} (pid {exc.pid}) is serving {config.data_dir}: connect the MCP client "
                  f"to {where}, or give another --data-dir")
    try:
        with contextlib.redirect_stdout(sys.stderr):  # nothing but JSON-RPC on stdout, from the first byte
            memory = Memory(config)
    except (OSError, ModelNotFoundError, StoreError, RuntimeError, TypeError, ValueError) as exc:
        _fail(str(exc))
    try:
        run_stdio(MemoryTools(memory))
    finally:
        memory.close()
        if lock is not None:
            serve_lock.release(config.data_dir)  # a clean stop leaves no serve.lock

if __name__ == "__main__":
    app()
