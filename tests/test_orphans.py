"""Nothing outlives its owner (issue 53, item 1, the script path): a plain script that used
``Memory.generate`` and is then killed, with SIGKILL, SIGTERM or a Ctrl-C, leaves no process of its tree
behind (vLLM's engine core and worker, the capture writer, multiprocessing's resource tracker)
20 s later. Before, all of them ran on as orphans: the engine core did not watch its parent
(:mod:`inferscale.serving.orphans`)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time

from pathlib import Path

import psutil
import pytest

from inferscale.kv.capture_writer import SPOOL_PREFIX, remove_dead_spools

pytestmark = pytest.mark.slow
SHM = Path("/dev/shm")

SCRIPT = textwrap.dedent("""
    import sys, time
    from inferscale import Memory

    m = Memory(data_dir=sys.argv[1], dtype="float32")
    m.add("I keep bees on my roof.", user_id="alice")
    m.generate("What do I keep?", user_id="alice", max_tokens=4)
    print("READY", flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=["SIGKILL", "SIGTERM", "Ctrl-C"])
def test_a_killed_script_leaves_no_process_of_its_tree(tmp_path, sig):
    """SIGKILL and SIGTERM to the script alone; Ctrl-C as a terminal sends it, SIGINT to the
    whole foreground process group (the script, vLLM's engine core and worker, the writer)."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "data")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 600)
        assert ready and proc.stdout.readline().strip() == b"READY", proc.stderr.read1().decode()[-3000:]
        tree = psutil.Process(proc.pid).children(recursive=True)
        names = [p.name() for p in tree]
        assert any("EngineCore" in n for n in names) and any("Worker" in n for n in names), names
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        proc.wait(30)
        assert proc.returncode == -sig  # ended as Python's default ends a script: no handler of ours
        stderr = proc.stderr.read().decode()
        extra = [line for line in stderr.splitlines() if line.strip() and not line.startswith("inferscale: ")]
        if sig == signal.SIGTERM:  # and cleanly: past our progress notices, one line and no traceback
            assert len(extra) <= 1 and all("is gone: stopping the engine" in line for line in extra), stderr
        if sig == signal.SIGINT:  # Python's KeyboardInterrupt in the script's own line, and nothing of vLLM's or ours
            assert extra[0] == "Traceback (most recent call last):" and extra[-1] == "KeyboardInterrupt", stderr
            assert len(extra) == 4 and "time.sleep(600)" in extra[2], stderr
        deadline = time.monotonic() + 20
        while (alive := running(tree)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not alive, [(p.pid, p.name()) for p in alive]
        assert_no_spool_left({proc.pid, *(p.pid for p in tree)})
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in running(tree):  # a failed test's leftovers
            p.kill()


def assert_no_spool_left(pids: set[int]) -> None:
    """The spools processes ``pids`` left in /dev/shm are dead ones: the next capture writer's
    start removes them (:func:`~inferscale.kv.capture_writer.remove_dead_spools`)."""
    left = [p for p in SHM.glob(f"{SPOOL_PREFIX}*-*") if int(p.name[len(SPOOL_PREFIX):].split("-")[0]) in pids]
    remove_dead_spools(SHM)
    assert not [p for p in left if p.exists()]


def running(processes: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("how", ["restart", "SIGTERM"])
def test_a_killed_notebook_kernel_leaves_no_process_of_its_tree(tmp_path, how):
    """A Jupyter kernel that used ``Memory.generate`` (and had a cell interrupted, after which
    the engine still answers), then ended as a kernel restart or a closed notebook server ends
    it (``shutdown_kernel(now=True)``: SIGKILL), or by a SIGTERM (a job scheduler, ``kill``): it
    exits, and its children with it."""
    from jupyter_client import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(tmp_path))
    tree: list[psutil.Process] = []
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=300)
        code = (f"from inferscale import Memory\nm = Memory(data_dir={str(tmp_path / 'data')!r}, dtype='float32')\n"
                "m.add('I keep bees on my roof.', user_id='alice')\n"
                "m.generate('What do I keep?', user_id='alice', max_tokens=4)")
        reply = kc.execute_interactive(code, timeout=900)
        assert reply["content"]["status"] == "ok", reply["content"]
        # the notebook's Interrupt (SIGINT to the kernel's process group) stops the cell, not the engine
        kc.execute("import time; time.sleep(120)")
        time.sleep(3)
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=60)
        assert reply["content"].get("ename") == "KeyboardInterrupt", reply["content"]
        reply = kc.execute_interactive("m.generate('What do I keep?', user_id='alice', max_tokens=4)", timeout=300)
        assert reply["content"]["status"] == "ok", reply["content"]
        kc.stop_channels()
        kernel_pid = km.provisioner.process.pid
        tree = psutil.Process(kernel_pid).children(recursive=True)
        names = [p.name() for p in tree]
        assert any("EngineCore" in n for n in names) and any("Worker" in n for n in names), names
        if how == "restart":
            km.shutdown_kernel(now=True)
        else:
            kernel = km.provisioner.process
            km.signal_kernel(signal.SIGTERM)
            kernel.wait(60)  # the kernel itself ends
        deadline = time.monotonic() + 20
        while (alive := running(tree)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not alive, [(p.pid, p.name()) for p in alive]
        assert_no_spool_left({kernel_pid, *(p.pid for p in tree)})  # its makers may be zombies still: gone
    finally:
        if km.is_alive():
            km.shutdown_kernel(now=True)
        for p in running(tree):
            p.kill()


def test_a_killed_serve_with_replicas_leaves_no_process_of_its_tree(tmp_path):
    """``inferscale serve --replicas 2`` (two vLLM OpenAI servers, each with its engine core,
    worker and capture writer), SIGKILLed once ready: nothing of it runs 20 s later."""
    import httpx

    from inferscale.server.ports import free_port

    port = free_port()
    exe = Path(sys.executable).with_name("inferscale")
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(exe), "serve", "--replicas", "2", "--port", str(port), "--data-dir",
                                 str(tmp_path / "data")], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "INFERSCALE_DTYPE": "float32"})
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        tree = psutil.Process(proc.pid).children(recursive=True)
        names = [p.name() for p in tree]
        assert sum("EngineCore" in n for n in names) == 2, names  # one engine core a replica
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 20
        while (alive := running(tree)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in running(tree):
            p.kill()
