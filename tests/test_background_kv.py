"""Writes are acknowledged before their KV exists: the background encoder, its durable
queue, serving facts without KV as text, and updates racing an in-flight encode."""

import os
import subprocess
import sys
import textwrap

import pytest

from inferscale import Memory
from inferscale.store.records import Scope

@pytest.fixture
def mem(tmp_path):
    m = Memory(data_dir=tmp_path / "store", dtype="float32", context_window=0)
    yield m
    m.close()


def test_add_returns_with_the_encode_queued_and_wait_for_kv_finishes_it(mem):
    mem.components.kv.background.pause()
    added = mem.add([{"role": "user", "content": "I keep bees on my roof."},
                     {"role": "user", "content": "My bike is a green Bianchi."}], user_id="u")["results"]
    assert mem.pending_kv() == 2  # durable jobs, nothing encoded yet
    inj = mem.inject("What is my bike?", user_id="u", k=2)
    assert sorted(inj.text_memory_ids) == sorted(r["id"] for r in added) and inj.kv_memory_ids == []
    assert inj.plan.memory_end == len(mem.components.prompts.preamble_ids)  # only the preamble is injected
    assert not mem.wait_for_kv(timeout=0.5)  # paused: still pending
    mem.components.kv.background.resume()
    assert mem.wait_for_kv(timeout=600) and mem.pending_kv() == 0
    again = mem.inject("What is my bike?", user_id="u", k=2)
    assert sorted(again.kv_memory_ids) == sorted(r["id"] for r in added) and again.text_memory_ids == []


def test_ready_facts_come_first_then_the_rest_as_text(mem):
    first = mem.add("I was born in Porto.", user_id="u")["results"][0]["id"]
    assert mem.wait_for_kv(timeout=600)
    mem.components.kv.background.pause()
    second = mem.add("I was born in April.", user_id="u")["results"][0]["id"]
    inj = mem.inject("Where and when was I born?", user_id="u", k=2)
    assert inj.kv_memory_ids == [first] and inj.text_memory_ids == [second]
    fact_ids = [s.key.split("/")[0] for s in inj.plan.segments[1:]]
    assert fact_ids == [first]  # the plan covers the preamble and the ready fact only
    text_line = mem.components.prompts.fact_line_ids("I was born in April.")
    start = inj.plan.memory_end
    assert inj.prompt_token_ids[start : start + len(text_line)] == text_line  # then the other fact as text
    waited = mem.inject("Where and when was I born?", user_id="u", k=2, wait_for_kv=True)
    assert sorted(waited.kv_memory_ids) == sorted([first, second]) and waited.text_memory_ids == []


def test_an_update_racing_an_in_flight_encode_never_leaves_the_old_kv(mem):
    mem.components.kv.background.pause()
    mid = mem.add("My locker code is 1234.", user_id="u")["results"][0]["id"]
    (job,) = mem.components.kv.jobs.take(10)
    old_key = mem.components.kv.fact_spans(Scope("u").key, [mem.components.facts.get(Scope("u"), mid)], 0)[0].key
    real_encode = mem.components.kv.encoder.encode

    def encode_while_updating(items):
        out = real_encode(items)  # the old text's KV is computed...
        mem.update(mid, "My locker code is 9876.", user_id="u")  # ...and the fact changes before it is stored
        return out

    mem.components.kv.encoder.encode = encode_while_updating
    try:
        mem.components.kv.run_jobs([job])
    finally:
        mem.components.kv.encoder.encode = real_encode
    assert not mem.components.pool.contains(old_key)  # written after the invalidation, then removed
    mem.components.kv.background.resume()
    assert mem.wait_for_kv(timeout=600)
    inj = mem.inject("What is my locker code?", user_id="u", k=1)
    assert inj.kv_memory_ids == [mid] and inj.plan.keys[1] != old_key
    assert mem.tokenizer.decode(inj.prompt_token_ids).count("9876") == 1 and "1234" not in mem.tokenizer.decode(
        inj.prompt_token_ids)


def test_delete_drops_queued_jobs(mem):
    mem.components.kv.background.pause()
    mid = mem.add("I own a red kayak.", user_id="u")["results"][0]["id"]
    assert mem.pending_kv() == 1
    mem.delete(mid, user_id="u")
    assert mem.pending_kv() == 0


CRASH = textwrap.dedent(
    """
    import os, sys
    from inferscale import Memory
    mem = Memory(data_dir=sys.argv[1], dtype="float32", context_window=0)
    mem.components.kv.background.pause()
    mem.add([{"role": "user", "content": f"Fact number {i} about my garden."} for i in range(6)], user_id="crash")
    print("PENDING", mem.pending_kv(), flush=True)
    os._exit(9)  # killed with the jobs queued
    """
)


def test_jobs_pending_at_a_crash_are_encoded_on_restart(tmp_path):
    store = tmp_path / "store"
    out = subprocess.run([sys.executable, "-c", CRASH, str(store)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ))
    assert out.returncode == 9 and "PENDING 6" in out.stdout, out.stderr[-2000:]
    with Memory(data_dir=store, dtype="float32", context_window=0) as mem:  # restarts the encoder
        assert mem.wait_for_kv(timeout=600) and mem.pending_kv() == 0
        inj = mem.inject("What about my garden?", user_id="crash", k=6)
        assert len(inj.kv_memory_ids) == 6 and inj.text_memory_ids == []


def test_a_fact_added_and_asked_at_once_is_answered_as_text_then_injected(serving_dir, engine):
    mem = Memory(data_dir=serving_dir, dtype="float32", engine=engine, context_window=0)
    user = "bg-hamster"
    mem.components.kv.background.pause()
    fid = mem.add("My hamster is called Pickles.", user_id=user)["results"][0]["id"]
    first = mem.generate("What is my hamster called?", user_id=user, k=1, max_tokens=12)  # no waiting
    preamble = len(mem.components.prompts.preamble_ids)
    assert first.text_memory_ids == [fid] and first.kv_memory_ids == []
    assert first.num_injected_tokens == preamble  # the fact was prefilled as text
    assert "Pickles" in first.text
    mem.components.kv.background.resume()
    assert mem.wait_for_kv(timeout=600)
    later = mem.generate("What is my hamster called?", user_id=user, k=1, max_tokens=12)
    assert later.kv_memory_ids == [fid] and later.text_memory_ids == []
    assert later.num_injected_tokens == preamble + len(mem.components.prompts.fact_line_ids("My hamster is called Pickles."))
    assert later.text == first.text  # the same tokens, the same greedy answer


def test_processes_sharing_a_queue_each_take_other_jobs_and_a_dead_ones_claims_are_released(tmp_path):
    """Two front processes (``serve --workers 2``) drain one queue: a job claimed by a live
    process is not taken by another; when that process dies its jobs are taken again."""
    from inferscale.kv.jobs import KVJobQueue, process_owner

    path = tmp_path / "kv_jobs.sqlite"
    mine, theirs = KVJobQueue(path), KVJobQueue(path)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        theirs.owner = process_owner(other.pid)  # as if the other process had opened it
        mine.add([(f"f{i}", "user:u", 0) for i in range(6)])
        taken_by_them = theirs.take(4)
        assert [j.fact_id for j in taken_by_them] == ["f0", "f1", "f2", "f3"]
        assert [j.fact_id for j in mine.take(10)] == ["f4", "f5"]  # theirs are skipped
        assert mine.claimable() == 2 and mine.pending() == 6
        mine.add([("f0", "user:u", 0)])  # f0 written again: a new job anyone may take
        assert [j.fact_id for j in mine.take(10)] == ["f4", "f5", "f0"]
        theirs.done(taken_by_them)  # the old f0 job's removal leaves the new one
        assert mine.pending() == 3
        mine.add([("g0", "user:u", 0)])
        assert [j.fact_id for j in theirs.take(1)] == ["g0"]
    finally:
        other.kill()
        other.wait()
    assert [j.fact_id for j in mine.take(10)] == ["f4", "f5", "f0", "g0"]  # the dead process's claim released


def test_closing_ends_the_batch_under_way_and_gives_its_jobs_back(tmp_path):
    """A close (``Memory.close``, or the exit after a Ctrl-C) does not wait for the batch under
    way to land: the batch ends at its next wave or poll, its jobs stay queued, unclaimed, for
    the next process; the close returns in well under its 60 s join."""
    import threading
    import time

    from inferscale.kv.background import BackgroundEncoder
    from inferscale.kv.jobs import KVJobQueue, process_owner

    path = tmp_path / "kv_jobs.sqlite"
    queue = KVJobQueue(path)
    started = threading.Event()
    encoder: BackgroundEncoder

    def run_batch(jobs):  # as the engine encoder: waves, then a wait for KV that never lands
        started.set()
        while True:
            encoder.yield_now()
            time.sleep(0.02)

    encoder = BackgroundEncoder(queue, run_batch, gather_s=0)
    queue.add([(f"f{i}", "user:u", 0) for i in range(3)])
    encoder.notify()
    assert started.wait(30)
    t0 = time.monotonic()
    encoder.close()
    assert time.monotonic() - t0 < 5
    assert encoder.failures == 0 and queue.pending() == 3
    other = KVJobQueue(path)
    other.owner = process_owner(1)  # a live process (init): it may take them, so no claim is left
    assert [j.fact_id for j in other.take(10)] == ["f0", "f1", "f2"]


def test_wait_idle_waits_for_the_batch_under_way_and_none_starts_after_a_pause(tmp_path):
    """``pause`` then ``wait_idle`` (how ``bench encode`` stops the encoder between phases): the
    batch under way finishes, no other starts, and the rest stays queued."""
    import threading
    import time

    from inferscale.kv.background import BackgroundEncoder
    from inferscale.kv.jobs import KVJobQueue

    queue = KVJobQueue(tmp_path / "kv_jobs.sqlite")
    started, ran = threading.Event(), []

    def run_batch(jobs):
        started.set()
        time.sleep(1.0)
        ran.append(len(jobs))

    encoder = BackgroundEncoder(queue, run_batch, batch_jobs=2, gather_s=0)
    queue.add([(f"f{i}", "user:u", 0) for i in range(6)])
    encoder.notify()
    assert started.wait(30)
    encoder.pause()
    assert encoder.wait_idle(30)
    assert ran == [2] and queue.pending() == 4  # the batch under way ended; no other began
    time.sleep(0.5)
    assert ran == [2]
    encoder.resume()
    assert encoder.wait(60) and ran == [2, 2, 2]
    encoder.close()


def _pending_after(mem, seconds: float) -> int:
    """The queue's pending encodes after ``seconds`` (polled, so the encoder is not asked to
    hurry: :meth:`Memory.wait_for_kv` would override its waiting for requests)."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and mem.pending_kv() > 0:
        time.sleep(0.1)
    return mem.pending_kv()


def test_the_encoder_waits_for_requests_in_flight_then_encodes(mem):
    """Issue 39: a background encode never competes with a request. While a request is in
    flight (a ``pinned_kv`` block, as ``generate`` and the front hold one), a queued encode
    waits; it runs once the request ends; ``wait_for_kv`` asks for it at once."""
    mem.add("I grow tomatoes on my balcony.", user_id="u")
    assert _pending_after(mem, 600) == 0  # no request: encoded at once (the encoder model loaded)
    with mem.pinned_kv(()):  # a request in flight
        mem.add("My cat sleeps in the sink.", user_id="u")
        assert _pending_after(mem, 3) == 1  # waits for the request
        assert mem.kv_stats()["encoder_yielded_seconds"] > 2
    assert _pending_after(mem, 120) == 0  # the request ended: encoded
    with mem.pinned_kv(()):
        mem.add("My sister lives in Oslo.", user_id="u")
        assert mem.wait_for_kv(timeout=120)  # someone waits for the KV: encoded during the request
    assert mem.kv_stats()["encode_seconds"] > 0


def test_with_encode_when_idle_off_the_encoder_runs_during_requests(tmp_path):
    with Memory(data_dir=tmp_path / "store", dtype="float32", context_window=0, encode_when_idle=False) as m:
        with m.pinned_kv(()):
            m.add("I grow tomatoes on my balcony.", user_id="u")
            assert _pending_after(m, 600) == 0
        assert m.kv_stats()["encoder_yielded_seconds"] == 0
