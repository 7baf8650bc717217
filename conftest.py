"""Shared fixtures: the real default model, one fp32 encoder and one vLLM engine.

vLLM's engine (``AsyncLLM``, its engine core in a process of its own) is started once per
test session; every test that serves requests shares it and the KV pool folder its
connector reads.
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _a_data_dir_of_the_suites_own() -> None:
    """Nothing the suite runs uses the user's data dir (``$INFERSCALE_DATA_DIR`` or
    ``~/.local/share/inferscale``): a CLI run without ``--data-dir`` (``serve --workers 2``
    in the option tests) took its ``serve.lock``, and a user's ``inferscale mcp`` on the
    default folder was refused as "served" while the suite ran. Every process the suite
    starts inherits this folder; it is removed at the end."""
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="inferscale-suite-data-")
    os.environ["INFERSCALE_DATA_DIR"] = folder
    atexit.register(shutil.rmtree, folder, ignore_errors=True)


_a_data_dir_of_the_suites_own()

from pathlib import Path

import pytest

from inferscale.models.resolve import resolve_llm


def _transformers_encoder_by_default() -> None:
    """This process's memories encode KV with the transformers reference unless a test asks for
    the engine (``kv_encoder="engine"``, ``Memory(engine=...)``): with the default, each of the
    suite's hundreds of embedded stores would start a vLLM engine of its own at its first
    ``wait_for_kv`` (20-60 s each). Processes the tests start (scripts, ``inferscale serve``,
    the CLI) keep the real default, and tests/test_embedded_engine.py runs it embedded."""
    from inferscale.config import MemoryConfig

    MemoryConfig.model_fields["kv_encoder"].default = "transformers"
    MemoryConfig.model_rebuild(force=True)


_transformers_encoder_by_default()


@pytest.fixture(scope="session")
def model_path() -> Path:
    return resolve_llm()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


@pytest.fixture(scope="session")
def encoder(model_path):
    from inferscale.kv.encoder import KVEncoder

    return KVEncoder(model_path, "float32")


@pytest.fixture(scope="session")
def serving_dir(tmp_path_factory) -> Path:
    """The data dir whose ``kv/`` folder the session's engine reads."""
    return tmp_path_factory.mktemp("serving")


@pytest.fixture(scope="session")
def engine(model_path, serving_dir):
    from inferscale.serving.engine import Engine

    with Engine(model_path, dtype="float32", kv_dir=serving_dir / "kv", max_model_len=4096,
                kv_cache_memory_bytes=1 << 30) as engine:
        yield engine


@pytest.fixture(scope="session")
def locomo_path() -> Path:
    path = Path(__file__).resolve().parents[1] / "shared" / "data" / "locomo" / "locomo10.json"
    assert path.is_file(), f"LoCoMo data expected at {path} (../shared beside the checkout)"
    return path


@pytest.fixture(scope="session")
def assert_refused():
    """``assert_refused(memory, user_id, call, error, name)``: ``call()`` raises exactly
    ``error`` (a ``TypeError`` is not a ``ValueError`` and back), in one line naming ``name``,
    and changes none of ``user_id``'s memories, turns, nor the store's size (issue 18)."""
    from inferscale.store.records import Scope

    def snapshot(memory, user_id: str) -> tuple:
        return (sorted((r["id"], r["memory"], str(r["metadata"]), r["updated_at"])
                       for r in memory.get_all(user_id=user_id, limit=1000)["results"]),
                memory.components.turns.count(Scope(user_id).key), memory.components.store.count(), memory.pending_kv())

    def check(memory, user_id: str, call, error: type[Exception], name: str) -> None:
        before = snapshot(memory, user_id)
        with pytest.raises(error) as caught:
            call()
        assert not isinstance(caught.value, ValueError if error is TypeError else TypeError), repr(caught.value)
        assert name in str(caught.value), str(caught.value)
        assert "\n" not in str(caught.value).strip(), str(caught.value)  # one line
        assert snapshot(memory, user_id) == before

    return check


# ---------------------------------------------------------------- services on loopback (issue 14)

def free_port() -> int:
    """A TCP port nothing listens on now (127.0.0.1)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def front_on_loopback(memory, api_key: str | None = None):
    """``inferscale serve``'s front (its memory routes; no vLLM behind it) over ``memory``, on a
    loopback port in a thread; yields its base URL."""
    import threading
    import time

    import uvicorn

    from inferscale.server.app import create_app
    from inferscale.server.upstream import Upstream

    port = free_port()
    app = create_app(memory, Upstream(f"http://127.0.0.1:{free_port()}"), api_key=api_key)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the front did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="session")
def loopback_front():
    """:func:`front_on_loopback`, for tests outside this folder: ``with loopback_front(memory,
    key) as url: ...``."""
    return front_on_loopback


def _start_chroma(path: Path, port: int, log: Path):
    import subprocess
    import sys

    chroma = Path(sys.executable).with_name("chroma")
    proc = subprocess.Popen([str(chroma), "run", "--path", str(path), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT)
    return _listening(proc, port, log, "chroma run", 120)


def _listening(proc, port: int, log: Path, what: str, seconds: float):
    """``proc`` once it accepts connections on 127.0.0.1:``port`` (killed, with its log's tail
    in the error, if it dies or does not listen within ``seconds``)."""
    import socket
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc
        except OSError:
            assert proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"{what} did not listen on {port}: {log.read_text()[-2000:]}")


@pytest.fixture
def unused_port() -> int:
    """A loopback TCP port nothing listens on."""
    return free_port()


@pytest.fixture
def chroma(tmp_path):
    """A real Chroma server (``chroma run``) on loopback: ``{"url", "port", "restart", "stop", "start"}``."""
    port = free_port()
    state = {"proc": _start_chroma(tmp_path / "chroma-server", port, tmp_path / "chroma.log"), "port": port,
             "url": f"http://127.0.0.1:{port}"}

    def stop() -> None:
        state["proc"].terminate()
        state["proc"].wait(timeout=60)

    def start() -> None:
        state["proc"] = _start_chroma(tmp_path / "chroma-server", port, tmp_path / "chroma.log")

    def restart() -> None:
        stop()
        start()

    state["restart"], state["stop"], state["start"] = restart, stop, start
    yield state
    if state["proc"].poll() is None:
        state["proc"].terminate()
        state["proc"].wait(timeout=60)


def _pg_bin(name: str) -> str:
    import glob
    import shutil

    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or [shutil.which(name)]
    assert found[-1], f"{name} not found: scripts/install.sh installs Debian's postgresql"
    return found[-1]


class _Postgres:
    """A fresh PostgreSQL cluster (Debian's package) on 127.0.0.1, trust auth."""

    def __init__(self) -> None:
        import shutil
        import subprocess
        import tempfile

        self.root = Path(tempfile.mkdtemp(prefix="inferscale-pg-"))
        self.root.chmod(0o755)
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []  # initdb refuses root
        if self.as_user:
            shutil.chown(self.root, "postgres", "postgres")
        self.data, self.port = self.root / "data", free_port()
        subprocess.run([*self.as_user, _pg_bin("initdb"), "-D", str(self.data), "-U", "inferscale", "--auth=trust",
                        "-E", "UTF8"], check=True, capture_output=True, timeout=300)
        self.url = f"postgresql+psycopg://inferscale@127.0.0.1:{self.port}/postgres"
        self.start()

    def start(self) -> None:
        import subprocess

        subprocess.run([*self.as_user, _pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"), "-w",
                        "-t", "120", "-o", f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1", "start"],
                       check=True, capture_output=True, timeout=300)

    def stop(self) -> None:
        import subprocess

        subprocess.run([*self.as_user, _pg_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"],
                       capture_output=True, timeout=120)

    def delete(self) -> None:
        import shutil

        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres_url():
    """A fresh PostgreSQL cluster (Debian's package) on 127.0.0.1, trust auth; its SQLAlchemy
    URL. Stopped and deleted afterwards."""
    pg = _Postgres()
    try:
        yield pg.url
    finally:
        pg.delete()


@pytest.fixture
def postgres():
    """Like ``postgres_url``, for one test that stops and starts the server: ``.url``,
    ``.stop()`` (fast shutdown: sessions are cut), ``.start()``."""
    pg = _Postgres()
    try:
        yield pg
    finally:
        pg.delete()


def _redis_bin() -> str:
    import shutil

    found = shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None)
    assert found, "redis-server not found: scripts/install.sh installs Debian's redis-server"
    return found


def _start_redis(port: int, log: Path):
    import subprocess

    # no persistence (a cache), LFU eviction under maxmemory, as docs/deployment.md says to run it
    proc = subprocess.Popen([_redis_bin(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lfu",
                             "--protected-mode", "no"], stdout=log.open("ab"), stderr=subprocess.STDOUT)
    return _listening(proc, port, log, "redis-server", 60)


@pytest.fixture
def redis_server(tmp_path):
    """A real Redis (Debian's redis-server) on loopback: ``{"url", "port", "kill", "start"}``;
    ``kill()`` ends it at once (SIGKILL), ``start()`` starts it again, empty, on the same port."""
    port = free_port()
    state = {"proc": _start_redis(port, tmp_path / "redis.log"), "port": port, "url": f"redis://127.0.0.1:{port}/0"}

    def kill() -> None:
        state["proc"].kill()
        state["proc"].wait(timeout=30)

    def start() -> None:
        state["proc"] = _start_redis(port, tmp_path / "redis.log")

    state["kill"], state["start"] = kill, start
    yield state
    if state["proc"].poll() is None:
        state["proc"].kill()
        state["proc"].wait(timeout=30)


def _cluster_port(taken: set[int]) -> int:
    """A port for a Redis Cluster node: at most 55535 with it and its cluster bus port
    (port + 10000, Redis's rule) both free now. The OS's ephemeral ports (``free_port``) run to
    60999, which Redis refuses for a cluster node."""
    import random
    import socket

    for _ in range(1000):
        port = random.randint(20000, 55535)
        if {port, port + 10000} & taken:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        taken |= {port, port + 10000}
        return port
    raise AssertionError("no free port pair (port, port + 10000) below 55536 for a Redis cluster node")


@pytest.fixture
def redis_cluster(tmp_path):
    """A real three-node Redis Cluster (no replicas) on loopback: ``{"url"}`` of its first
    node (clients find the others from it)."""
    import subprocess
    import time

    taken: set[int] = set()
    ports, procs = [_cluster_port(taken) for _ in range(3)], []
    try:
        for port in ports:
            folder = tmp_path / f"redis-{port}"
            folder.mkdir()
            procs.append(subprocess.Popen(
                [_redis_bin(), "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", str(folder / "nodes.conf"), "--dir", str(folder), "--save", "",
                 "--appendonly", "no", "--protected-mode", "no"],
                stdout=(folder / "log").open("ab"), stderr=subprocess.STDOUT))
            _listening(procs[-1], port, folder / "log", "a Redis cluster node", 60)
        import shutil

        cli = shutil.which("redis-cli") or "/usr/bin/redis-cli"
        deadline = time.monotonic() + 60
        done = subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas",
                               "0", "--cluster-yes"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        while "cluster_state:ok" not in subprocess.run([cli, "-p", str(ports[0]), "cluster", "info"],
                                                       capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, "the Redis cluster did not come up"
            time.sleep(0.2)
        yield {"url": f"redis://127.0.0.1:{ports[0]}/0", "ports": ports}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)
