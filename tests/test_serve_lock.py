"""``<data_dir>/serve.lock`` names its holder: an ``inferscale mcp`` is not called a server, and
commands that must not run beside one (``copy-to-chroma``, ``reembed``) say which and why."""

from __future__ import annotations

import pytest

from inferscale.store import serve_lock
from inferscale.store.records import StoreError
from inferscale.store.reembed import reembed


def test_the_lock_names_its_holder_and_frees_with_it(tmp_path):
    held = serve_lock.hold(tmp_path, "inferscale mcp")
    with pytest.raises(serve_lock.DataDirServed, match=r"an inferscale mcp \(pid \d+\) is serving") as info:
        serve_lock.check_free(tmp_path)
    assert info.value.command == "inferscale mcp"
    with pytest.raises(StoreError, match=r"inferscale mcp \(pid \d+\) .*: stop it before re-embedding"):
        reembed(tmp_path, None, "x", lambda texts: None, progress=False)
    held.close()
    serve_lock.check_free(tmp_path)  # free again


def test_a_lock_file_from_before_names_a_server(tmp_path):
    held = serve_lock.hold(tmp_path)
    held.seek(0)
    held.truncate(0)
    held.write("4242")  # what older versions wrote: the pid alone
    held.flush()
    with pytest.raises(serve_lock.DataDirServed, match=r"an inferscale serve \(pid 4242\)"):
        serve_lock.check_free(tmp_path)
    held.close()


def test_a_memory_is_refused_a_data_dir_another_process_serves(tmp_path):
    """Two writers of one Chroma folder corrupt each other (the server then answers 500s):
    ``Memory()`` on a data dir an ``inferscale serve`` of another process holds is refused,
    naming its pid, and creates nothing; the server's own process opens it, and so does
    anyone once the server is gone."""
    import subprocess
    import sys

    from inferscale import Memory

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from inferscale.store import serve_lock; f = serve_lock.hold(Path(sys.argv[1])); "
                               "print('held', flush=True); time.sleep(600)", str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreError, match=rf"an inferscale serve \(pid {holder.pid}\) is serving .*one writer: "
                                             r"reach its memories over HTTP"):
            Memory(data_dir=tmp_path, precompute_kv=False)
        assert not (tmp_path / "chroma").exists()
    finally:
        holder.kill()
        holder.wait()
    own = serve_lock.hold(tmp_path / "mine")
    with Memory(data_dir=tmp_path / "mine", precompute_kv=False) as memory:  # the server's own process
        memory.add("Ana keeps bees.", user_id="ana", infer=False)
    own.close()
    with Memory(data_dir=tmp_path, precompute_kv=False) as memory:  # the server is gone
        assert memory.count(user_id="ana") == 0


def test_a_check_at_the_moment_a_server_starts_does_not_refuse_it(tmp_path):
    """``check_free`` takes the lock for a moment: a server taking it then waits, not fails.
    And a lock file holding bytes that are not UTF-8 still names its holder."""
    import threading

    stop = threading.Event()
    checks = []

    def check_in_a_loop():
        while not stop.is_set():
            try:
                serve_lock.check_free(tmp_path)
                checks.append(True)
            except serve_lock.DataDirServed:
                checks.append(False)

    (tmp_path / serve_lock.LOCK_FILE).write_text("")
    checker = threading.Thread(target=check_in_a_loop)
    checker.start()
    try:
        for _ in range(200):
            serve_lock.hold(tmp_path).close()  # each must get the lock
    finally:
        stop.set()
        checker.join()
    assert checks.count(True) > 0
    held = serve_lock.hold(tmp_path)
    held.seek(0)
    held.truncate(0)
    held.buffer.write(b"4242 \xff\xfe serve")
    held.flush()
    with pytest.raises(serve_lock.DataDirServed, match=r"\(pid 4242\)"):
        serve_lock.check_free(tmp_path)
    held.close()
