"""Locks that mean what they say (issue 53, item 2), with real second processes:

- ``inferscale serve`` refuses a data dir whose embedded store a ``Memory`` of another process
  has open, naming that process, and writes nothing (the reverse is tests/test_serve_lock.py);
- a child forked after its parent opened a ``Memory`` can neither use the parent's ``Memory``
  nor open one of its own over the store while the parent holds it: one clear error each,
  and the parent's store holds none of the child's writes;
- a lock left by a process that was killed never blocks, and a clean close or stop removes
  its own lock file (the server's, tests/test_server.py's restart test).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from inferscale import Memory
from inferscale.server.ports import free_port
from inferscale.store import open_lock, serve_lock

HOLDS = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from inferscale import Memory
    from inferscale.store import serve_lock

    m = Memory(data_dir=sys.argv[1], dtype="float32", precompute_kv=False)
    m.add("The holder was here.", user_id="u", infer=False)
    if len(sys.argv) > 2:
        serve_lock.hold(Path(sys.argv[2]))
    print("HELD", flush=True)
    time.sleep(600)
""")

FORKS = textwrap.dedent("""
    import json, multiprocessing, os, sys
    from inferscale import Memory

    m = Memory(data_dir=sys.argv[1], dtype="float32", precompute_kv=False)
    m.add("The parent was here.", user_id="u", infer=False)

    def attempt(call):
        try:
            call()
            return "accepted"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    def child(queue):
        queue.put({
            "inherited": attempt(lambda: m.add("The child used its parent's Memory.", user_id="u", infer=False)),
            "read": attempt(lambda: m.get_all(user_id="u")),
            "own": attempt(lambda: Memory(data_dir=sys.argv[1], dtype="float32", precompute_kv=False).add(
                "The child opened a Memory of its own.", user_id="u", infer=False)),
        })

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue,))
    proc.start()
    out = queue.get(timeout=300)
    proc.join(60)
    m.add("The parent still writes.", user_id="u", infer=False)
    out.update(exitcode=proc.exitcode, pid=os.getpid(),
               memories=sorted(r["memory"] for r in m.get_all(user_id="u")["results"]))
    print(json.dumps(out))
""")


def start_holder(tmp_path: Path, *extra: str) -> subprocess.Popen:
    script = tmp_path / "holds.py"
    script.write_text(HOLDS)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "data"), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line == "HELD", proc.stderr.read()[-3000:]
    return proc


def test_a_server_refuses_a_data_dir_an_embedded_memory_of_another_process_holds(tmp_path):
    holder = start_holder(tmp_path)
    try:
        exe = Path(sys.executable).with_name("inferscale")
        done = subprocess.run([str(exe), "serve", "--port", str(free_port()), "--data-dir", str(tmp_path / "data")],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "INFERSCALE_DTYPE": "float32"})
        assert done.returncode != 0
        said = (done.stdout + done.stderr).strip().splitlines()
        assert len(said) == 1 and said[0].startswith("error: "), said
        assert f"is open in pid {holder.pid} (holds.py" in said[0] and "one process at a time" in said[0], said
        assert not (tmp_path / "data" / "serve.lock").exists()  # the refused server leaves no lock
        assert not (tmp_path / "data" / "logs").exists()  # and started no vLLM
    finally:
        holder.kill()
        holder.wait()
    with Memory(data_dir=tmp_path / "data", dtype="float32", precompute_kv=False) as m:  # nothing else written
        assert [r["memory"] for r in m.get_all(user_id="u")["results"]] == ["The holder was here."]


def test_a_forked_child_can_neither_use_its_parents_memory_nor_open_the_store(tmp_path):
    script = tmp_path / "forks.py"
    script.write_text(FORKS)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "data")], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for call in ("inherited", "read"):
        assert out[call].startswith(f"RuntimeError: this Memory was opened in process {out['pid']}, and this "
                                    "process is a child forked from it"), out
        assert "get_context('spawn')" in out[call] and "\n" not in out[call]
    assert out["own"].startswith("StoreError: ") and f"is open in pid {out['pid']}" in out["own"], out
    assert out["exitcode"] == 0
    assert out["memories"] == ["The parent still writes.", "The parent was here."]  # none of the child's


def test_a_lock_left_by_a_killed_process_never_blocks_and_a_clean_close_removes_its_own(tmp_path):
    holder = start_holder(tmp_path, str(tmp_path / "served"))
    assert (tmp_path / "data" / "chroma" / open_lock.OPEN_LOCK).is_file()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    # both files stay behind a SIGKILL, naming a dead process: neither blocks
    assert (tmp_path / "served" / serve_lock.LOCK_FILE).is_file()
    serve_lock.check_free(tmp_path / "served")
    held = serve_lock.hold(tmp_path / "served")
    assert (tmp_path / "served" / serve_lock.LOCK_FILE).read_text() == f"{os.getpid()} inferscale serve"
    serve_lock.release(tmp_path / "served")
    assert not (tmp_path / "served" / serve_lock.LOCK_FILE).exists() and held.closed
    serve_lock.check_free(tmp_path / "served")  # and a missing file is free, not created
    assert not (tmp_path / "served" / serve_lock.LOCK_FILE).exists()

    with Memory(data_dir=tmp_path / "data", dtype="float32", precompute_kv=False) as m:
        assert m.count(user_id="u") == 1
        assert (tmp_path / "data" / "chroma" / open_lock.OPEN_LOCK).read_text().startswith(f"{os.getpid()} ")
    assert not (tmp_path / "data" / "chroma" / open_lock.OPEN_LOCK).exists()
