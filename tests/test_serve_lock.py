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
