"""KV files no longer served are collected (issue 53, item 3; :mod:`inferscale.kv.garbage`),
without a disk budget: a data dir reopened with another dtype (or model) removes every entry
file of the old one, and one reopened with another ``kv_storage_dtype`` removes the files of
the storage it no longer serves, keeping the model-dtype files a quantized storage is made
from; a folder from before ``served.json`` keeps its files. Real stores, real KV files."""

from __future__ import annotations

import json

from inferscale import Memory
from inferscale.kv.garbage import SERVED, file_storage

FACTS = ["I keep bees on my roof.", "My sister Ana lives in Porto.", "I play the cello on Sundays."]


def storages(m: Memory) -> list[str]:
    """The storage of every KV entry file in the memory's folder, sorted (preamble included)."""
    disk = m.components.pool.disk
    return sorted(file_storage(disk.path(key)) for _, _, key in disk.scan())


def served(m: Memory) -> dict:
    return json.loads((m.kv_dir / SERVED).read_text())


def test_another_dtype_or_storage_removes_what_is_no_longer_served(tmp_path, capfd):
    data = tmp_path / "data"
    with Memory(data_dir=data, dtype="float32", context_window=0) as m:
        for fact in FACTS:
            m.add(fact, user_id="u")
        assert m.wait_for_kv(600)
        assert storages(m) == ["model"] * 4  # three facts and the preamble
        assert served(m) == {"fingerprint": m.components.kv.fingerprint, "dtype": "float32", "storage": "auto"}

    with Memory(data_dir=data, dtype="float32", kv_storage_dtype="int8", context_window=0) as m:
        assert storages(m) == ["model"] * 4  # kept: the int8 KV is made from them, without an encode
        m.prepare("Where does Ana live?", user_id="u", k=1)  # quantizes one memory's KV, dropping its model file
        assert storages(m) == ["int8", "model", "model", "model"]
    with Memory(data_dir=data, dtype="float32", kv_storage_dtype="int4", context_window=0) as m:
        assert storages(m) == ["model"] * 3  # int8 is no longer served
    capfd.readouterr()
    with Memory(data_dir=data, dtype="bfloat16", kv_storage_dtype="int4", precompute_kv=False) as m:
        assert storages(m) == []  # float32 KV cannot serve a bfloat16 model
        assert served(m)["dtype"] == "bfloat16"
    said = capfd.readouterr().err
    assert "inferscale: removed 3 KV file(s) of dtype float32 from" in said, said


def test_a_folder_from_before_keeps_its_files_and_is_given_a_record(tmp_path):
    data = tmp_path / "data"
    with Memory(data_dir=data, dtype="float32", context_window=0) as m:
        m.add(FACTS[0], user_id="u")
        assert m.wait_for_kv(600)
    (data / "kv" / SERVED).unlink()  # as a folder written before served.json was
    with Memory(data_dir=data, dtype="bfloat16", precompute_kv=False) as m:
        assert len(storages(m)) == 2  # settings unknown: nothing removed
        assert served(m)["dtype"] == "bfloat16"
