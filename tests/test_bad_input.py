"""Bad input gets a clear error and changes nothing (found by trying to break the API)."""

import json

import pytest

from inferscale import FactInput, Memory
from inferscale.datasets.locomo import LocomoFormatError, load_locomo
from inferscale.kv.pool import kv_key, validate_key
from inferscale.models.resolve import ModelNotFoundError
from inferscale.kv.injection import InjectionPlan
from inferscale.store.records import Scope, StoreError

def new_memory(path, **kw) -> Memory:
    return Memory(data_dir=path, dtype="float32", context_window=0, precompute_kv=False, **kw)


def state(mem: Memory, user: str) -> tuple:
    return (sorted(r["memory"] for r in mem.get_all(user_id=user)["results"]), mem.components.turns.count(Scope(user).key),
            mem.components.store.count(), mem.components.facts.count(Scope(user)))


@pytest.fixture
def mem(tmp_path):
    m = new_memory(tmp_path / "store")
    m.add("My dog is called Rex.", user_id="u")
    return m


def test_oversized_facts_are_refused_before_anything_is_written(mem):
    before = state(mem, "u")
    with pytest.raises(ValueError, match="max_fact_tokens"):
        mem.add("peanut butter is great. " * 400, user_id="u")
    with pytest.raises(ValueError, match="max_fact_tokens"):
        mem.add_facts(["fine", "too long " * 600], user_id="u")
    mid = mem.get_all(user_id="u")["results"][0]["id"]
    with pytest.raises(ValueError, match="max_fact_tokens"):
        mem.update(mid, "My dog is huge. " * 300, user_id="u")
    assert state(mem, "u") == before
    assert mem.get(mid, user_id="u")["memory"] == "My dog is called Rex."
    assert [e["event"] for e in mem.history(mid, user_id="u")] == ["ADD"]


def test_prompts_longer_than_the_context_are_refused(tmp_path):
    small = new_memory(tmp_path / "small", max_model_len=256)
    small.add_facts([f"Fact number {i} says something moderately long about the user." for i in range(20)],
                    user_id="u")
    with pytest.raises(ValueError, match="max_model_len=256"):
        small.inject("What do you know?", user_id="u", k=20)


def test_a_vllm_cache_too_small_for_max_model_len_is_named_in_our_settings_before_vllm_starts(tmp_path):
    small = new_memory(tmp_path / "small", kv_cache_memory_bytes=16 << 20, max_model_len=256)
    small.add("My dog is called Rex.", user_id="u")
    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match="gives vLLM 128 tokens") as caught:  # 2 blocks of 128, one kept back
        small.generate("What is my dog called?", user_id="u", max_tokens=4)
    assert "at least 17,825,792 bytes (17 MiB" in str(caught.value)  # (2 + 1) blocks x 128 x 46,080, whole MiB
    assert "lower max_model_len" not in str(caught.value)  # 128 is below max_model_len's least
    assert small._engine is None  # vLLM never started: no traceback from its process, nothing left at exit
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == files  # refused before any KV was written
    small.close()
    fits = new_memory(tmp_path / "small", kv_cache_memory_bytes=17 << 20, max_model_len=256)  # what it said
    try:
        answer = fits.generate("What is my dog called?", user_id="u", max_tokens=4)
        assert answer.text and fits._engine is not None  # vLLM took it
    finally:
        fits.close()
    from inferscale.models.kv_shape import check_kv_cache_fits

    check_kv_cache_fits(tmp_path / "no-model", "float32", 1 << 20, 16 << 20)  # no config.json: left to vLLM
    odd = tmp_path / "odd"
    odd.mkdir()
    for fields in ({"num_hidden_layers": "30"}, {"num_hidden_layers": 0, "hidden_size": 8, "num_attention_heads": 0},
                   {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": -1}):
        (odd / "config.json").write_text(__import__("json").dumps(fields))
        check_kv_cache_fits(odd, "float32", 1 << 20, 16 << 20)  # not a decoder's config: left to vLLM


@pytest.mark.parametrize("facts", ["hello", FactInput("x"), None, 5])
def test_add_facts_wants_a_list(mem, facts):
    before = state(mem, "u")
    with pytest.raises(TypeError, match="list"):
        mem.add_facts(facts, user_id="u")
    assert state(mem, "u") == before


def test_malformed_provenance_and_messages(mem):
    before = state(mem, "u")
    with pytest.raises(TypeError, match="source_turn_ids"):
        mem.add_facts([FactInput("x", "d1")], user_id="u")
    with pytest.raises(TypeError, match="source_turn_ids"):
        mem.add_facts([FactInput("x", (5,))], user_id="u")
    with pytest.raises(TypeError, match="name must be a string"):
        mem.add({"content": "x", "name": [1]}, user_id="u")
    with pytest.raises(TypeError, match="got int"):
        mem.add(5, user_id="u")
    with pytest.raises(TypeError, match="list of message dicts"):
        mem.log_turns(None, user_id="u")
    with pytest.raises(ValueError, match="Unicode"):
        mem.add("bad \ud800 text", user_id="u")
    with pytest.raises(ValueError, match="reserved"):
        mem.add("x", user_id="u", metadata={"created_at": "yesterday"})
    with pytest.raises(ValueError, match="reserved"):
        mem.add_facts([FactInput("x", metadata={"updated_at": 1})], user_id="u")
    assert state(mem, "u") == before


def test_bad_search_and_generation_arguments(mem):
    for bad in (float("nan"), 5):
        with pytest.raises(ValueError, match="threshold"):
            mem.search("dog", user_id="u", threshold=bad)
    with pytest.raises(TypeError, match="threshold must be a number"):
        mem.search("dog", user_id="u", threshold="0.5")
    with pytest.raises(TypeError, match="filters must be a dict"):
        mem.search("dog", user_id="u", filters=[])
    assert mem.get_all(user_id="newcomer", filters={"topic": "x"})["results"] == []
    with pytest.raises(TypeError, match="temperature"):
        mem.generate("dog?", user_id="u", temperature="hot")
    with pytest.raises(ValueError, match="logprobs"):
        mem.generate("dog?", user_id="u", logprobs=-1)


def test_bad_models_fail_before_the_data_dir_is_touched(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        new_memory(tmp_path / "a", embedder=str(tmp_path / "no-such-embedder"))
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        new_memory(tmp_path / "b", llm=str(afile))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("damage", ["turns.sqlite", "kv"])
def test_damaged_stores_raise_store_error(tmp_path, damage):
    store = tmp_path / "store"
    new_memory(store).add("hello", user_id="u")
    target = store / damage
    if target.is_dir():
        import shutil

        shutil.rmtree(target)
        target.write_text("not a folder")
    else:
        target.unlink()
        target.mkdir()
    with pytest.raises(StoreError, match="damaged"):
        new_memory(store)


def test_malformed_kv_transfer_params_never_raise_anything_but_value_error():
    key = kv_key("_preamble", a=1)
    for params in (
        {"inferscale": {"memory_end": float("inf"), "segments": [[key, 0, 3]]}},
        {"inferscale": {"memory_end": 3, "segments": [[key, 0, 3.0]]}},
        {"inferscale": {"memory_end": True, "segments": [[key, 0, 1]]}},
        {"inferscale": "segments"},
        {"inferscale": {"memory_end": 3, "segments": [[key + "\n", 0, 3]]}},
    ):
        with pytest.raises(ValueError, match="malformed"):
            InjectionPlan.from_params(params)
    assert InjectionPlan.from_params("inferscale") is None
    with pytest.raises(ValueError):
        validate_key(key + "\n")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s["conversation"]["session_1"][0].pop("dia_id"),
        lambda s: s["qa"][0].pop("category"),
        lambda s: s.__setitem__("conversation", "text"),
        lambda s: s["conversation"]["session_1"][0].__setitem__("text", None),
        lambda s: s["qa"][0].__setitem__("category", "x"),
    ],
)
def test_malformed_locomo_samples_are_named(tmp_path, locomo_path, mutate):
    sample = json.loads(locomo_path.read_text())[0]
    mutate(sample)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([sample]))
    with pytest.raises(LocomoFormatError, match="sample 0"):
        load_locomo(bad)


def test_generation_options_are_checked_by_us_before_anything_runs(mem):
    from inferscale import GenerationOptions

    before = state(mem, "u")
    cases = [
        (dict(temperature=2.5), ValueError, "temperature"),  # vLLM's limit is 2: refused here, not by vLLM
        (dict(max_tokens=0), ValueError, "max_tokens"),
        (dict(max_tokens="5"), TypeError, "max_tokens"),
        (dict(k=-1), ValueError, "k"),
        (dict(mode="xx"), ValueError, "mode"),
        (dict(wait_for_kv="yes"), TypeError, "wait_for_kv"),
        (dict(max_token=3), TypeError, "max_token"),
        (dict(options="x"), TypeError, "options must be a GenerationOptions"),
    ]
    for kwargs, error, name in cases:
        with pytest.raises(error, match=name):
            mem.generate("dog?", user_id="u", **kwargs)
        with pytest.raises(error, match=name):
            mem.prepare("dog?", user_id="u", **kwargs)
    with pytest.raises(TypeError, match="max_token"):  # a typo'd field is never ignored
        GenerationOptions(max_token=3)
    with pytest.raises(TypeError, match="encode_kv"):
        mem.add_facts(["A fact."], user_id="u", encode_kv="no")
    with pytest.raises(TypeError, match="context_window"):
        mem.add_facts(["A fact."], user_id="u", context_window="2")
    with pytest.raises(TypeError, match="timeout"):
        mem.wait_for_kv(timeout="1")
    with pytest.raises(ValueError, match="timeout"):
        mem.wait_for_kv(timeout=-1)
    assert state(mem, "u") == before


def test_a_closed_memory_says_so(tmp_path):
    mem = Memory(data_dir=tmp_path / "store", dtype="float32", context_window=0)
    mem.add("I like tea.", user_id="u")  # its KV may still be queued at close: the next Memory encodes it
    mem.close()
    calls = {"add": lambda: mem.add("I like coffee.", user_id="u"), "search": lambda: mem.search("tea", user_id="u"),
             "get_all": lambda: mem.get_all(user_id="u"), "generate": lambda: mem.generate("What?", user_id="u"),
             "inject": lambda: mem.inject("What?", user_id="u"), "delete_all": lambda: mem.delete_all(user_id="u")}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="this Memory was closed"):
            call()
    assert mem.wait_for_kv(timeout=600) in (True, False)  # at once, not after the timeout
    with Memory(data_dir=tmp_path / "store", dtype="float32", context_window=0) as again:
        assert [r["memory"] for r in again.get_all(user_id="u")["results"]] == ["I like tea."]
        assert again.wait_for_kv(timeout=600) and again.pending_kv() == 0


def test_metadata_that_cannot_be_read_back_is_refused(mem):
    before = state(mem, "u")
    deep = 1
    for _ in range(40):
        deep = [deep]
    for bad, match in (({"x": float("nan")}, "NaN"), ({"x": float("inf")}, "NaN and Infinity"),
                       ({"a": deep}, "nested more than 32")):
        with pytest.raises(ValueError, match=match):
            mem.add("I like tea.", user_id="u", metadata=bad)
    assert state(mem, "u") == before


def test_a_memory_block_that_cannot_fit_the_context_is_refused_before_encoding(tmp_path):
    from inferscale.generation.options import GenerationOptions

    m = new_memory(tmp_path / "store", max_model_len=256)
    m.add_facts([f"Fact {i}: the user keeps a long list of things about topic {i} in a notebook." for i in range(12)],
                user_id="u", encode_kv=False)
    o = m.options(GenerationOptions(k=12, wait_for_kv=True))
    with pytest.raises(ValueError, match="lower memory.k"):
        m.components.requests.prepare_memory_block(Scope("u"), "what do I keep?", o)
    assert m.pending_kv() == 0 and not any(m.kv_dir.rglob("*.safetensors"))  # nothing was encoded
