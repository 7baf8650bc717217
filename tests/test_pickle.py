"""A Memory pickles as its settings, as a database client does: the same open Memory where
one is open over its store, the store opened anew elsewhere (another process)."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys

from inferscale import Memory


def test_unpickled_in_process_is_the_open_memory(tmp_path):
    with Memory(data_dir=tmp_path / "store", dtype="float32", precompute_kv=False) as mem:
        assert pickle.loads(pickle.dumps(mem)) is mem
        assert copy.deepcopy({"m": mem})["m"] is mem


def test_unpickled_in_another_process_opens_the_store_with_the_same_settings(tmp_path):
    with Memory(data_dir=tmp_path / "store", dtype="float32", precompute_kv=False, top_k=7) as mem:
        mem.add("I keep bees on the roof.", user_id="u", infer=False)
        blob = tmp_path / "memory.pickle"
        blob.write_bytes(pickle.dumps(mem))
    script = ("import pickle, sys\n"
              "m = pickle.loads(open(sys.argv[1], 'rb').read())\n"
              "print(m.config.top_k, m.config.dtype, [r['memory'] for r in m.get_all(user_id='u')['results']])\n")
    out = subprocess.run([sys.executable, "-c", script, str(blob)], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)  # another working directory: data_dir was made absolute
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "7 float32 ['I keep bees on the roof.']"
    assert out.stderr == ""  # exits cleanly: nothing printed at exit


def test_a_closed_memory_unpickles_as_a_new_one(tmp_path):
    mem = Memory(data_dir=tmp_path / "store", dtype="float32", precompute_kv=False)
    mem.add("I keep bees on the roof.", user_id="u", infer=False)
    blob = pickle.dumps(mem)
    mem.close()
    with pickle.loads(blob) as again:
        assert again is not mem
        assert [r["memory"] for r in again.get_all(user_id="u")["results"]] == ["I keep bees on the roof."]


def test_of_two_memories_over_one_store_the_pickled_one_comes_back(tmp_path):
    with Memory(data_dir=tmp_path / "store", dtype="float32", precompute_kv=False) as first, \
            Memory(data_dir=tmp_path / "store", dtype="float32", precompute_kv=False) as second:
        assert pickle.loads(pickle.dumps(second)) is second
        assert pickle.loads(pickle.dumps(first)) is first
