"""A store embedded with one embedder is never opened with another (issue 43 item 2), and
``inferscale reembed`` moves it to the new one: the embedded store and a Chroma server, a
re-embed stopped half-way (refused until a second run finishes it), and the memories kept
whole (ids, texts, metadata). The "other" embedder is the default model named by its folder:
another name, the same weights, as no second model installs offline."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from inferscale import Memory
from inferscale.cli import app
from inferscale.config import DEFAULT_EMBEDDER
from inferscale.models.embedding import Embedder
from inferscale.models.resolve import resolve_embedder
from inferscale.store import reembed as reembed_module
from inferscale.store.chroma import ChromaServer, FactStore
from inferscale.store.embedded import copy_to_server
from inferscale.store.reembed import reembed
from inferscale.store.records import StoreError

FACTS = ["I live in Lisbon.", "My dog is called Rex.", "I work as a nurse.", "I play the cello."]
SETTINGS = dict(dtype="float32", context_window=0, precompute_kv=False)


@pytest.fixture(scope="module")
def other() -> str:
    return resolve_embedder(DEFAULT_EMBEDDER)  # a folder: another embedder name


def _fill(memory: Memory) -> dict[str, dict]:
    for i, text in enumerate(FACTS):
        memory.add(text, user_id="ana", metadata={"n": i}, infer=False)
    return {r["id"]: r for r in memory.get_all(user_id="ana")["results"]}


def _same(memory: Memory, before: dict[str, dict]) -> None:
    after = {r["id"]: r for r in memory.get_all(user_id="ana")["results"]}
    assert {i: (r["memory"], r["metadata"]) for i, r in after.items()} == \
        {i: (r["memory"], r["metadata"]) for i, r in before.items()}
    top = memory.search("Where do I live?", user_id="ana", limit=1)["results"][0]
    assert top["memory"] == "I live in Lisbon."


def test_another_embedder_is_refused_and_reembed_moves_the_store(tmp_path, other):
    with Memory(data_dir=tmp_path, **SETTINGS) as m:
        before = _fill(m)
    with pytest.raises(StoreError, match=f"inferscale reembed --embedder {other}"):
        Memory(data_dir=tmp_path, embedder=other, **SETTINGS)

    done = CliRunner().invoke(app, ["reembed", "--embedder", other, "--data-dir", str(tmp_path)])
    assert done.exit_code == 0, done.output
    assert f"re-embedded {len(FACTS)} memories" in done.output
    with Memory(data_dir=tmp_path, embedder=other, **SETTINGS) as m:
        _same(m, before)
    with pytest.raises(StoreError, match=f"inferscale reembed --embedder {DEFAULT_EMBEDDER}"):
        Memory(data_dir=tmp_path, **SETTINGS)  # the old name is now the other one
    again = CliRunner().invoke(app, ["reembed", "--embedder", other, "--data-dir", str(tmp_path)])
    assert again.exit_code == 0 and "nothing to re-embed" in again.output


def test_a_reembed_stopped_half_way_is_refused_until_a_second_run_finishes_it(tmp_path, other):
    with Memory(data_dir=tmp_path, **SETTINGS) as m:
        before = _fill(m)
    model = Embedder(other, "cpu", source=other)
    calls = []

    def failing(texts):
        calls.append(texts)
        if len(calls) == 2:
            raise RuntimeError("killed")
        return model.encode(texts).numpy()

    with pytest.raises(StoreError, match="refused until `inferscale reembed --embedder .* --data-dir .*` runs to its end"):
        reembed(tmp_path, None, other, failing, batch=2, progress=False)
    for name in (DEFAULT_EMBEDDER, other):  # neither embedder may open a half-moved store
        with pytest.raises(StoreError, match="stopped half-way"):
            Memory(data_dir=tmp_path, embedder=name, **SETTINGS)
    assert reembed(tmp_path, None, other, lambda t: model.encode(t).numpy(), batch=2, progress=False) == len(FACTS)
    with Memory(data_dir=tmp_path, embedder=other, **SETTINGS) as m:
        _same(m, before)


def test_a_chroma_server_collection_names_its_embedder_for_every_deployment(tmp_path, chroma, other):
    """Two data dirs over one server collection: the second, set to another embedder, is
    refused by the collection itself (its own manifest is new), and the re-embed serves both."""
    settings = dict(SETTINGS, chroma_url=chroma["url"])
    with Memory(data_dir=tmp_path / "a", **settings) as a:
        before = _fill(a)
    with pytest.raises(StoreError, match=f"inferscale reembed --embedder {other}"):
        Memory(data_dir=tmp_path / "b", embedder=other, **settings)
    done = CliRunner().invoke(app, ["reembed", "--embedder", other, "--data-dir", str(tmp_path / "b"),
                                    "--chroma-url", chroma["url"]])
    assert done.exit_code == 0, done.output
    with Memory(data_dir=tmp_path / "b", embedder=other, **settings) as b:
        _same(b, before)
    with pytest.raises(StoreError, match="embedded with"):
        Memory(data_dir=tmp_path / "a", **settings)  # a's manifest vouches for the old one: the collection refuses


def test_reembed_refuses_bad_input_with_one_line(tmp_path):
    missing = CliRunner().invoke(app, ["reembed", "--embedder", "x", "--data-dir", str(tmp_path / "none")])
    assert missing.exit_code == 2 and "nothing to re-embed" in missing.output
    (tmp_path / "f").write_text("")
    afile = CliRunner().invoke(app, ["reembed", "--embedder", "x", "--data-dir", str(tmp_path / "f")])
    assert afile.exit_code == 2 and "is a file" in afile.output


def test_an_open_store_is_not_re_embedded_under_its_writer(tmp_path, other):
    """A Memory holds its store's open lock: a re-embed would drop the collection it writes."""
    with Memory(data_dir=tmp_path, **SETTINGS) as m:
        _fill(m)
        refused = CliRunner().invoke(app, ["reembed", "--embedder", other, "--data-dir", str(tmp_path)])
        assert refused.exit_code == 2 and f"is open in pid {os.getpid()} (" in refused.output, refused.output
        m.add("I moved to Porto.", user_id="ana", infer=False)  # still writable: nothing was marked
    assert CliRunner().invoke(app, ["reembed", "--embedder", other, "--data-dir", str(tmp_path)]).exit_code == 0
    with Memory(data_dir=tmp_path, embedder=other, **SETTINGS) as m:
        assert m.count(user_id="ana") == len(FACTS) + 1


def test_a_stop_around_the_swap_is_finished_with_the_copys_own_embedder(tmp_path, other, monkeypatch):
    """Stopped after the original was dropped (and an empty collection created in its place):
    a rerun asking for another embedder renames the complete copy under its own embedder
    first, then re-embeds it; nothing is lost and no label lies."""
    with Memory(data_dir=tmp_path, **SETTINGS) as m:
        before = _fill(m)
    model = Embedder(other, "cpu", source=other)
    real = reembed_module._take_name

    def stop(*args, **kwargs):
        raise RuntimeError("killed between the drop and the rename")

    monkeypatch.setattr(reembed_module, "_take_name", stop)
    with pytest.raises(StoreError, match="runs to its end"):
        reembed(tmp_path, None, other, lambda t: model.encode(t).numpy(), progress=False)
    monkeypatch.setattr(reembed_module, "_take_name", real)
    with pytest.raises(StoreError, match=f"stopped half-way: run `inferscale reembed --embedder {other} --data-dir"):
        Memory(data_dir=tmp_path, embedder=other, **SETTINGS)
    with pytest.raises(StoreError, match="has not ended"):  # nor copied to a server meanwhile
        copy_to_server(tmp_path, ChromaServer("http://127.0.0.1:9"))
    FactStore(tmp_path / "chroma").close()  # an empty stand-in under the original's name
    default = Embedder(DEFAULT_EMBEDDER, "cpu", source=other)
    assert reembed(tmp_path, None, DEFAULT_EMBEDDER, lambda t: default.encode(t).numpy(), progress=False) == len(FACTS)
    with Memory(data_dir=tmp_path, **SETTINGS) as m:
        _same(m, before)


def test_a_damaged_manifest_is_named_and_nothing_changes(tmp_path, other):
    with Memory(data_dir=tmp_path, **SETTINGS) as m:
        _fill(m)
    (tmp_path / "inferscale.json").write_text("{not json")
    done = CliRunner().invoke(app, ["reembed", "--embedder", other, "--data-dir", str(tmp_path)])
    assert done.exit_code == 2 and "the manifest" in done.output and "inferscale.json" in done.output
    assert FactStore(tmp_path / "chroma").metadata.get("inferscale_reembedding") is None
