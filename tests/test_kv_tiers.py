"""The KV pool as a bounded cache (issue 31): a byte budget per tier, the disk's eviction
order by decayed use counts (LRFU), the memory tiers' least recently used out first, pinned KV never evicted, eviction remembered for provenance, a
second write after an eviction counted as a re-encode."""

from __future__ import annotations

import gc
import math
import os
import time

import pytest
import torch

from inferscale.kv.disk import DiskTier, used_priority
from inferscale.kv.pool import FactKV, KVPool, kv_key, to_storage
from inferscale.kv.tiers import MemoryTier


def kv(tokens: int = 8, seed: int = 0) -> FactKV:
    g = torch.Generator().manual_seed(seed)
    return FactKV(torch.randn(2, tokens, 2, 32, generator=g), torch.randn(2, tokens, 2, 32, generator=g),
                  tuple(range(tokens)))


def file_size(pool: KVPool, key: str) -> int:
    return pool._path(key).stat().st_size


def budgeted(tmp_path, keys, files: float) -> tuple[KVPool, int]:
    """A pool whose disk budget holds ``files`` files of :func:`kv` (measured on a probe pool),
    and the size of one."""
    probe = KVPool(tmp_path / "probe", "cpu", 1 << 30)
    probe.put(keys[0], kv())
    one = file_size(probe, keys[0])
    return KVPool(tmp_path / "pool", "cpu", 1 << 30, disk_budget_bytes=int(files * one)), one


@pytest.fixture
def keys():
    return [kv_key(f"fact{i}", i=i) for i in range(8)]


def age(pool: KVPool, keys: list[str]) -> None:
    """Give ``keys`` increasing modification times, oldest first (a clock of our own: the file
    system's is too coarse for writes a microsecond apart)."""
    t = time.time() - 1000
    for i, key in enumerate(keys):
        os.utime(pool._path(key), (t + i, t + i))


def test_the_disk_tier_keeps_to_its_budget_least_recently_used_out_first(tmp_path, keys):
    one = None
    pool = KVPool(tmp_path, "cpu", 1 << 30)
    for key in keys[:4]:
        pool.put(key, kv())
        one = file_size(pool, key)
    age(pool, keys[:4])
    os.utime(pool._path(keys[0]), None)  # the oldest is used again: now the most recent
    budget = int(4.5 * one)
    small = KVPool(tmp_path, "cpu", 1 << 30, disk_budget_bytes=budget)
    small.put(keys[4], kv(seed=4))  # 5 files > 4.5: evicted down to 90% of the budget (4.05): 4 files
    assert small.disk.size() <= budget
    assert not small.contains(keys[1]) and small.was_evicted(keys[1])  # the least recently used went first
    assert small.contains(keys[0]) and small.contains(keys[4])  # renewed, and just written
    assert small.tier(keys[1]) is None and small.get(keys[1]) is None
    assert small.stats["disk_evictions"] >= 1 and small.stats["disk_evicted_bytes"] >= one


def test_a_write_burst_keeps_disk_and_device_to_their_budgets_plus_one_fact(tmp_path):
    """Four writers (the background encoder and requests encoding at once) put 80 facts into
    a pool with room for about ten on disk and five on the device; a sampler scanning the
    folder (temporary files included) never sees more than the budget plus one fact."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    burst = [kv_key(f"burst{i}", i=i) for i in range(80)]
    probe = KVPool(tmp_path / "probe", "cpu", 1 << 30)
    probe.put(burst[0], kv(tokens=1200))
    one = file_size(probe, burst[0])
    device_budget, disk_budget = 5 * one, int(10.5 * one)
    pool = KVPool(tmp_path / "pool", "cpu", device_budget, disk_budget_bytes=disk_budget)
    seen, done = [], threading.Event()

    def sample():
        while not done.is_set():
            total = 0
            for entry in os.scandir(pool.root) if pool.root.exists() else ():
                try:
                    total += sum(f.stat().st_size for f in os.scandir(entry.path))
                except OSError:  # a folder or file removed mid-scan
                    pass
            seen.append((total, pool._device.bytes))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(4) as writers:
            list(writers.map(lambda i: pool.put(burst[i], kv(tokens=1200, seed=i)), range(80)))
    finally:
        done.set()
        sampler.join()
    assert len(seen) > 10 and max(d for _, d in seen) <= device_budget
    assert max(t for t, _ in seen) <= disk_budget + one
    assert pool.disk.size() <= disk_budget and pool.stats["disk_evictions"] >= 65


def test_what_is_not_an_entry_is_never_counted_or_evicted_and_leftovers_are_swept(tmp_path, keys, caplog):
    """A stray model file, a link out of the folder, a crashed writer's temporary file, a
    corrupt entry, a clock that jumped, yesterday's preamble: the budget counts entries only,
    evicts none of what is not its own, and repairs what it can."""
    import logging

    pool = KVPool(tmp_path / "kv", "cpu", 1 << 30)
    for i, key in enumerate(keys[:4]):
        pool.put(key, kv(tokens=600, seed=i))
    one = file_size(pool, keys[0])
    stray = tmp_path / "kv" / "my-model" / "model.safetensors"
    stray.parent.mkdir()
    stray.write_bytes(b"x" * 3 * one)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ("0" * 32 + ".safetensors")).write_bytes(b"y" * one)
    (tmp_path / "kv" / "linked").symlink_to(elsewhere)
    stale = pool._path(keys[1]).parent / ".tmp-crashed.safetensors"
    stale.write_bytes(b"z" * one)
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    old_preamble, preamble = kv_key("_preamble", day=1), kv_key("_preamble", day=2)
    pool.put(old_preamble, kv(tokens=600, seed=8))
    pool.put(preamble, kv(tokens=600, seed=9))
    age(pool, [old_preamble, keys[0], keys[1], keys[2], preamble])
    future = time.time() + 30 * 365 * 86400  # a file from a machine whose clock was 30 years ahead
    os.utime(pool._path(keys[3]), (future, future))
    entries = pool.disk.scan()
    assert {k for _, _, k in entries} == {*keys[:4], old_preamble, preamble}  # no stray file, no link
    assert not stale.exists() and pool.disk.size() == sum(size for _, size, _ in entries)

    pool.set_disk_budget(int(3.4 * one))  # down to about three files
    assert pool.tier(old_preamble) is None and pool.tier(preamble) == "device"  # the newest preamble stays
    assert pool.disk.exists(preamble) and not pool.disk.exists(keys[3])  # the future file ranks as new, not first
    assert stray.exists() and (elsewhere / ("0" * 32 + ".safetensors")).exists()
    assert not pool._path(keys[0]).parent.exists()  # an evicted owner's empty folder goes too

    kept = [k for k in keys[:4] if pool.disk.exists(k)]
    pool._path(kept[0]).write_bytes(b"not safetensors")  # corrupt (a crash without fsync)
    pool._device.clear()
    caplog.set_level(logging.WARNING, logger="inferscale.kv.disk")
    assert pool.get(kept[0]) is None and not pool.contains(kept[0])  # absent now: encoded again when needed
    assert any("unreadable" in r.getMessage() for r in caplog.records)


def test_pinned_kv_is_never_evicted_and_a_miss_is_encoded_again_once(tmp_path, keys):
    pool, _ = budgeted(tmp_path, keys, 2.5)
    pool.put(keys[0], kv())
    pool.put(keys[1], kv())
    age(pool, keys[:2])
    with pool.pinned([keys[0]]):
        with pool.pinned([keys[0]]):  # pins nest (two requests using one memory)
            pool.put(keys[2], kv())
        pool.put(keys[3], kv())
        assert pool.contains(keys[0])  # the oldest, but pinned by a request in flight
        assert not pool.contains(keys[1]) and not pool.contains(keys[2])
    assert pool._pins == {}
    age(pool, [keys[0], keys[3]])
    pool.put(keys[4], kv())  # unpinned now: the oldest goes
    assert not pool.contains(keys[0]) and pool.was_evicted(keys[0])
    before = pool.stats["reencodes"]
    pool.put(keys[0], kv())  # the miss, encoded again
    assert pool.stats["reencodes"] == before + 1 and not pool.was_evicted(keys[0])


PINNER = """
import sys
from inferscale.kv.pool import KVPool

pool = KVPool(sys.argv[1], "cpu", 1 << 30, disk_budget_bytes=int(sys.argv[2]))  # a front worker of its own
with pool.pinned(sys.argv[3:]):  # a request in flight there
    print("pinned", flush=True)
    sys.stdin.readline()
print("done", flush=True)
sys.stdin.readline()
"""


def test_a_request_in_another_process_keeps_its_kv_from_this_ones_eviction(tmp_path, keys):
    import signal
    import subprocess
    import sys

    pool, one = budgeted(tmp_path, keys, 3.5)
    for i, key in enumerate(keys[:3]):
        pool.put(key, kv(seed=i))
    age(pool, keys[:3])
    other = subprocess.Popen([sys.executable, "-c", PINNER, str(pool.root), str(pool.disk.budget_bytes), keys[0]],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "pinned"
        pool.put(keys[3], kv(seed=3))  # 4 files > 3.5: the oldest that no request pins goes
        assert pool.contains(keys[0]) and not pool.contains(keys[1])
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "done"  # the other request finished: unpinned
        age(pool, [keys[0], keys[2], keys[3]])
        pool.put(keys[4], kv(seed=4))
        assert not pool.contains(keys[0]) and pool.contains(keys[3])
        assert list((pool.root / ".pins").iterdir()) == []
    finally:
        other.kill()
        other.wait()
    crashed = subprocess.Popen([sys.executable, "-c", PINNER, str(pool.root), str(pool.disk.budget_bytes), keys[3]],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert crashed.stdout.readline().strip() == "pinned"
    os.kill(crashed.pid, signal.SIGKILL)  # dies holding its pin: the file stays, the process does not
    crashed.wait()
    assert len(list((pool.root / ".pins").iterdir())) == 1
    age(pool, [keys[3], keys[2], keys[4]])
    pool.put(keys[5], kv(seed=5))
    assert not pool.contains(keys[3])  # a dead process's pin holds nothing, and its file is removed
    assert list((pool.root / ".pins").iterdir()) == []


def test_pins_are_written_without_a_budget_too_and_a_full_disk_is_read_from_any_error(tmp_path, keys):
    from safetensors import SafetensorError

    from inferscale.kv.disk import no_space

    pool = KVPool(tmp_path, "cpu", 1 << 30)  # no budget: the disk's reserve can still evict
    with pool.pinned([keys[0]]):
        (pin,) = (tmp_path / ".pins").iterdir()
        assert pin.read_text() == keys[0]
    assert list((tmp_path / ".pins").iterdir()) == []
    wrapped = OSError("cannot write KV file x")
    wrapped.__cause__ = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert no_space(wrapped) and no_space(OSError(28, "No space left on device"))
    assert not no_space(PermissionError(13, "Permission denied"))


def test_eviction_drops_the_memory_tiers_too_so_planning_and_loading_agree(tmp_path, keys):
    pool, _ = budgeted(tmp_path, keys, 1.5)
    pool.put(keys[0], kv())
    assert pool.tier(keys[0]) == "device"
    age(pool, keys[:1])
    pool.put(keys[1], kv())
    assert pool.tier(keys[0]) is None and pool.footprint()["device"] == kv().nbytes


def test_quantized_entries_are_what_the_budgets_count(tmp_path, keys):
    dense, q = kv(64), to_storage(kv(64), "int4")
    pool = KVPool(tmp_path, "cpu", device_budget_bytes=3 * q.nbytes)
    for key in keys[:3]:
        pool.put(key, q)
    assert pool.footprint()["device"] == 3 * q.nbytes < dense.nbytes  # three int4 facts fit where one dense does not


def test_a_host_tier_takes_what_the_device_tier_lets_go_and_gives_it_back(tmp_path, keys):
    pool = KVPool(tmp_path, "cpu", device_budget_bytes=kv().nbytes)
    pool._host = MemoryTier("host", 2 * kv().nbytes)  # on CUDA; the CPU's device tier is host memory already
    pool.put(keys[0], kv(seed=0))
    pool.put(keys[1], kv(seed=1))
    assert pool.tier(keys[0]) == "host" and pool.tier(keys[1]) == "device"
    got = pool.get(keys[0])
    assert torch.equal(got.keys, kv(seed=0).keys)
    assert pool.stats["host_hits"] == 1 and pool.tier(keys[0]) == "device" and pool.tier(keys[1]) == "host"
    pool.put(keys[2], kv(seed=2))
    pool.put(keys[3], kv(seed=3))  # the host tier holds two; the oldest leaves it (still on disk)
    assert pool.tier(keys[1]) == "disk" and pool.stats["host_evictions"] == 1


def test_the_host_tier_is_off_on_a_cpu_device_and_settings_must_match(tmp_path, monkeypatch):
    assert KVPool(tmp_path, "cpu", 1 << 20, host_budget_bytes=1 << 30).host_budget_bytes == 0
    KVPool.shared(tmp_path / "s", "cpu", 1 << 20, disk_budget_bytes=1 << 30)
    with pytest.raises(ValueError, match="disk_budget_bytes"):
        KVPool.shared(tmp_path / "s", "cpu", 1 << 20, disk_budget_bytes=2 << 30)
    from inferscale.config import MemoryConfig

    monkeypatch.setenv("INFERSCALE_DISK_KV_BUDGET_BYTES", "")  # set but empty: no limit, as when unset
    assert MemoryConfig(data_dir=tmp_path).disk_kv_budget_bytes is None


def test_the_last_release_lets_the_folder_open_again_with_other_settings(tmp_path):
    first = KVPool.shared(tmp_path / "s", "cpu", 1 << 20, disk_budget_bytes=1 << 30)
    second = KVPool.shared(tmp_path / "s", "cpu", 1 << 20, disk_budget_bytes=1 << 30)
    assert second is first
    first.release()  # one holder left: still the process's pool, still the same settings
    with pytest.raises(ValueError, match="already open in this process"):
        KVPool.shared(tmp_path / "s", "cpu", 1 << 20, disk_budget_bytes=2 << 30)
    second.release()
    second.release()  # past zero: nothing happens
    reopened = KVPool.shared(tmp_path / "s", "cpu", 1 << 20, disk_budget_bytes=2 << 30)
    assert reopened is not first and reopened.disk_budget_bytes == 2 << 30
    reopened.release()


def test_a_closed_memory_lets_its_folder_open_again_with_other_budgets(tmp_path, monkeypatch):
    import inferscale.components
    from inferscale import Memory

    first = Memory(data_dir=tmp_path, dtype="float32", disk_kv_budget_bytes=64 << 20, precompute_kv=False)
    first.add(FACTS[0], user_id="u", infer=False)
    other = Memory(data_dir=tmp_path, dtype="float32", disk_kv_budget_bytes=64 << 20, precompute_kv=False)
    other.close()  # the first still holds the folder's pool
    with pytest.raises(ValueError, match="close the Memory that opened it first"):
        Memory(data_dir=tmp_path, dtype="float32", disk_kv_budget_bytes=32 << 20)
    first.close()
    first.close()  # closing twice lets go once
    with monkeypatch.context() as patch:  # an open that fails after the pool lets go of it ...
        def broken(*args, **kwargs):
            raise RuntimeError("the embedder failed to load")

        patch.setattr(inferscale.components, "Embedder", broken)
        with pytest.raises(RuntimeError, match="embedder failed"):
            Memory(data_dir=tmp_path, dtype="float32", disk_kv_budget_bytes=16 << 20)
    again = Memory(data_dir=tmp_path, dtype="float32", disk_kv_budget_bytes=32 << 20)  # ... so this opens
    try:
        assert again.components.pool.disk_budget_bytes == 32 << 20
        assert [m["memory"] for m in again.get_all(user_id="u")["results"]] == [FACTS[0]]  # nothing lost
    finally:
        again.close()

    def forgotten() -> None:  # a notebook cell re-run: the old Memory is dropped, never closed
        Memory(data_dir=tmp_path, dtype="float32", disk_kv_budget_bytes=8 << 20).add(FACTS[1], user_id="u")

    forgotten()
    gc.collect()
    with Memory(data_dir=tmp_path, dtype="float32", disk_kv_budget_bytes=4 << 20) as last:
        assert last.components.pool.disk_budget_bytes == 4 << 20


FULL_DISK = """
import json, sys, torch
from inferscale.kv.pool import FactKV, KVPool, kv_key

pool = KVPool(sys.argv[1] + "/kv", "cpu", 1 << 30, disk_budget_bytes=1 << 40)  # a budget far past the disk
keys = [kv_key(f"fact{i}", i=i) for i in range(12)]
for i, key in enumerate(keys):  # ~0.6 MiB each: twelve do not fit in 4 MiB
    g = torch.Generator().manual_seed(i)
    pool.put(key, FactKV(torch.randn(2, 600, 2, 32, generator=g), torch.randn(2, 600, 2, 32, generator=g),
                         tuple(range(600))))
free, reserve = pool.disk.room()
out = {"on_disk": [pool.disk.exists(k) for k in keys], "evictions": pool.stats["disk_evictions"],
       "readable": [pool.disk.read(k).num_tokens for k in keys if pool.disk.exists(k)], "reserve_kept": free >= reserve}
kept = [k for k in keys if pool.disk.exists(k)]
with pool.pinned(kept):  # every entry in use, and other files take the rest: eviction cannot help
    with open(sys.argv[1] + "/other", "wb") as f:
        f.write(b"x" * (free - 4096))
    before = pool.stats["disk_evictions"]
    try:
        pool.put(kv_key("late", i=0), FactKV(torch.zeros(2, 600, 2, 32), torch.zeros(2, 600, 2, 32), tuple(range(600))))
    except OSError as exc:
        out["refused"] = type(exc).__name__
    out["evicted_in_vain"] = pool.stats["disk_evictions"] - before
    out["kept"] = all(pool.disk.exists(k) for k in kept)
print(json.dumps(out))
"""


def test_a_full_disk_evicts_to_make_room_instead_of_failing_the_write(tmp_path):
    import json
    import subprocess
    import sys

    mount = tmp_path / "disk"
    mount.mkdir()
    # a 4 MiB file system of its own, in a private mount namespace (gone when the process is)
    done = subprocess.run(["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=4m tmpfs "$1" && exec "$2" -c "$3" "$1"',
                           "sh", str(mount), sys.executable, FULL_DISK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["on_disk"][-1] and not all(out["on_disk"])  # every write landed; the oldest made room
    first_kept = out["on_disk"].index(True)
    assert all(out["on_disk"][first_kept:]) and out["evictions"] == first_kept  # oldest out first
    assert out["readable"] == [600] * (12 - first_kept)  # no file cut short
    assert out["reserve_kept"]  # 5% of the disk left to everything else on it (the store)
    assert done.stderr.count("evicting KV files to make room") == 1  # said once, with what to set
    assert "disk_kv_budget_bytes" in done.stderr
    assert out["refused"] == "DiskFullError" and out["evicted_in_vain"] == 0 and out["kept"]


FULL_KV_DISK = """
import json, sys
from inferscale import Memory

mem = Memory(data_dir=sys.argv[1], dtype="float32", context_window=0)  # its kv/ is a disk too small for any KV
mem.add("My dog is called Biscuit.", user_id="u", infer=False)
mem.add("I work as a nurse in Lisbon.", user_id="u", infer=False)
mem.wait_for_kv(timeout=3)  # the encoder waits for room: it does not drop or retry the jobs in a loop
plain = mem.inject("What is my dog called?", user_id="u")
waited = mem.inject("What is my dog called?", user_id="u", wait_for_kv=True)
print(json.dumps({"sources": sorted(set(plain.kv_sources.values()) | set(waited.kv_sources.values())),
                  "kv": plain.kv_memory_ids + waited.kv_memory_ids, "text": len(plain.text_memory_ids),
                  "pending": mem.pending_kv(), "memories": len(mem.get_all(user_id="u")["results"])}))
"""


def test_a_kv_disk_with_no_room_serves_memories_as_text_and_says_so_once(tmp_path):
    import json
    import subprocess
    import sys

    data = tmp_path / "data"
    (data / "kv").mkdir(parents=True)
    done = subprocess.run(["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=1m tmpfs "$1/kv" && exec "$2" -c "$3" "$1"',
                           "sh", str(data), sys.executable, FULL_KV_DISK], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["sources"] == ["text: KV disk full"] and out["kv"] == [] and out["text"] == 2
    assert out["pending"] == 2 and out["memories"] == 2  # kept for when there is room; nothing lost
    assert done.stderr.count("the KV disk is full") == 1, done.stderr  # one line, no traceback per batch
    assert "Traceback" not in done.stderr


def test_a_use_renews_recency_at_most_once_a_minute_per_entry(tmp_path, keys):
    pool = KVPool(tmp_path, "cpu", 1 << 30)
    pool.put(keys[0], kv())
    age(pool, keys[:1])
    old = pool._path(keys[0]).stat().st_mtime
    pool.use([keys[0]])  # written a moment ago: the write counts as the use
    assert pool._path(keys[0]).stat().st_mtime == old
    pool.disk._touched.clear()
    pool.use([keys[0]])
    assert pool._path(keys[0]).stat().st_mtime > old + 500


def uses(pool: KVPool, key: str, n: int) -> None:
    """``n`` uses of ``key`` counted (each as if a minute apart: the per-minute throttle cleared)."""
    for _ in range(n):
        pool.disk._touched.clear()
        pool.use([key])


@pytest.mark.parametrize("half_life_s", [3600.0, None])
def test_eviction_keeps_the_frequently_used_entry_over_the_last_used_one_lru_does_not(tmp_path, keys, half_life_s,
                                                                                       monkeypatch):
    monkeypatch.setattr(DiskTier, "HALF_LIFE_S", half_life_s)
    pool = KVPool(tmp_path, "cpu", 1 << 30)
    for i, key in enumerate(keys[:3]):
        pool.put(key, kv(tokens=1200, seed=i))  # ~1.2 MiB a file
    age(pool, keys[:3])
    uses(pool, keys[0], 3)  # used often, a while ago ...
    time.sleep(0.02)
    uses(pool, keys[1], 1)  # ... then another one, once
    evicted = pool.set_disk_budget(int(1.5 * file_size(pool, keys[0])))  # room for one
    assert evicted == 2
    kept = [k for k in keys[:3] if pool.tier(k) is not None]
    assert kept == ([keys[0]] if half_life_s else [keys[1]])


def test_a_uses_weight_halves_every_half_life():
    h, now = 3600.0, 1_000_000.0
    assert used_priority(now, now, h) == pytest.approx(now + h)  # a second use at once: count 2
    p = now
    for _ in range(3):
        p = used_priority(p, now, h)
    assert p == pytest.approx(now + h * math.log2(4))  # four uses: count 4
    later = now + 10 * h  # ten half-lives on, the four uses weigh 4 / 1024 ...
    assert used_priority(p, later, h) == pytest.approx(later + h * math.log2(1 + 4 / 1024))
    assert used_priority(p, later, h) < used_priority(later, later, h)  # ... less than two uses now
    assert used_priority(1e300, 0.0, h) == 1e300  # no overflow
    with pytest.raises(ValueError, match="positive"):
        used_priority(now, now, 0)


# ---------------------------------------------------------------- through Memory (real SmolLM2 KV)

FACTS = ["My dog is called Biscuit.", "I work as a nurse in Lisbon.", "My sister Ana plays the cello.",
         "I am allergic to peanuts.", "My favourite film is Spirited Away.", "I ride a red bicycle to work.",
         "My flat has a balcony full of basil.", "I learned to swim last summer."]


def test_an_evicted_memory_comes_as_text_says_why_and_is_encoded_again_once(tmp_path):
    from inferscale import Memory

    probe = Memory(data_dir=tmp_path / "probe", dtype="float32")
    probe.add(FACTS[0], user_id="u", infer=False)
    assert probe.wait_for_kv(timeout=600)
    files = list((tmp_path / "probe" / "kv").glob("*/*.safetensors"))
    one = max(p.stat().st_size for p in files if not p.parent.name.startswith("_"))
    preamble = sum(p.stat().st_size for p in files if p.parent.name.startswith("_"))
    probe.close()
    # room for the preamble (never evicted) and about six facts' KV; eight facts written: an
    # eviction pass leaves 90% of the budget, so two or three facts are evicted
    budget = preamble + int(6.5 * one)
    mem = Memory(data_dir=tmp_path / "m", dtype="float32", disk_kv_budget_bytes=budget)
    try:
        for fact in FACTS:
            mem.add(fact, user_id="u", infer=False)
        assert mem.wait_for_kv(timeout=600)
        mem.components.kv.background.pause()  # the evicted KV stays missing while we look
        first = mem.inject("What is my dog called?", user_id="u", k=len(FACTS))
        evicted = [i for i, why in first.kv_sources.items() if why == "text: evicted"]
        assert evicted and set(evicted) == set(first.text_memory_ids)  # what was evicted comes as text, saying so
        assert {first.kv_sources[i] for i in first.kv_memory_ids} <= {"device", "disk"}
        served = mem.kv_stats()  # the front's hits and misses, per memory planned
        assert served["served_text"] == len(evicted)
        assert served["served_device"] + served["served_disk"] == len(FACTS) - len(evicted)
        assert mem.kv_stats()["disk_evictions"] >= len(evicted)
        assert mem.kv_stats()["disk_bytes"] <= budget
        before = mem.kv_stats()["reencodes"]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as requests:  # eight concurrent requests ask for it before it is back
            again = list(requests.map(lambda _: mem.inject("What is my dog called?", user_id="u", k=len(FACTS)),
                                      range(8)))
        assert all(set(evicted) <= set(a.text_memory_ids) for a in again)
        assert mem.pending_kv() == len(evicted)  # queued once each
        mem.components.kv.background.resume()
        assert mem.wait_for_kv(timeout=600)
        assert mem.kv_stats()["reencodes"] - before == len(evicted)  # encoded again once, not eight times
        final = mem.inject("What is my dog called?", user_id="u", k=len(FACTS))
        assert all(final.kv_sources[i] in ("device", "disk") for i in evicted)  # the newest now, so kept
    finally:
        mem.close()


def test_a_lowered_budget_evicts_at_once_least_recently_used_first(tmp_path, keys):
    pool = KVPool(tmp_path, "cpu", 1 << 30)
    for i, key in enumerate(keys):
        pool.put(key, kv(tokens=600, seed=i))  # ~0.6 MiB a file
    age(pool, keys)
    one = file_size(pool, keys[0])
    assert pool.set_disk_budget(None) == 0
    evicted = pool.set_disk_budget(int(4.5 * one))  # down to 90% of it: four files stay
    assert evicted == 4 and [pool.tier(k) for k in keys] == [None] * 4 + ["device"] * 4
    assert pool.disk.size() <= int(4.5 * one) and pool.stats["disk_evictions"] == 4
    with pytest.raises(ValueError, match="at least 1 MiB"):
        pool.set_disk_budget(1000)
    for bad in ("5000000", float("inf"), True):
        with pytest.raises(TypeError, match="whole number of bytes or None"):
            pool.set_disk_budget(bad)
    assert pool.disk.budget_bytes == int(4.5 * one)  # unchanged


@pytest.mark.parametrize("asgi", ["2.4", "2.0"])
def test_a_streamed_answer_releases_its_pins_when_the_client_goes_before_the_first_byte(tmp_path, keys, asgi):
    """The server's relay of a streamed chat (``openai_routes.Relay``) holds the request's
    pins; a client gone before the first byte (the send fails under ASGI 2.4; under 2.0 the
    disconnect arrives at once) means the body never starts, and the pins must still go."""
    import asyncio
    from contextlib import ExitStack

    from inferscale.server.openai_routes import Relay

    pool = KVPool(tmp_path, "cpu", 1 << 30)
    pool.put(keys[0], kv())
    stack = ExitStack()
    stack.enter_context(pool.pinned([keys[0]]))
    started, finished = [], []

    async def body():
        started.append(True)
        yield "data: {}\n"

    async def finish():
        finished.append(True)
        stack.close()

    async def send(message):
        if asgi == "2.4":
            raise OSError("client gone")
        await asyncio.sleep(1)  # never gets far: the disconnect comes first

    async def receive():
        return {"type": "http.disconnect"}

    relay = Relay(body(), finish, media_type="text/event-stream")
    scope = {"type": "http", "asgi": {"spec_version": asgi}}
    try:
        asyncio.run(relay(scope, receive, send))
    except Exception:  # ASGI 2.4: Starlette's ClientDisconnect, as a server would see it
        assert asgi == "2.4"
    assert not started and finished == [True] and pool._pins == {}


def test_a_budget_smaller_than_what_must_stay_says_so_once(tmp_path, caplog):
    """A preamble larger than the budget (1 MiB, the least allowed, under fp32 KV of a few
    hundred tokens) cannot be evicted: every write then evicts the fact just before it. The
    log says so once, with the numbers, instead of thrashing silently."""
    import logging

    caplog.set_level(logging.WARNING, logger="inferscale.kv.pool")
    pool = KVPool(tmp_path, "cpu", 1 << 30, disk_budget_bytes=1 << 20)
    pool.put(kv_key("_preamble", v=1), kv(tokens=1200))
    for i in range(3):
        pool.put(kv_key(f"fact{i}", i=i), kv(tokens=100, seed=i))
    said = [r.getMessage() for r in caplog.records if "smaller than the KV the pool must keep" in r.getMessage()]
    assert len(said) == 1 and "1048576 bytes" in said[0]
    assert pool.disk.exists(kv_key("_preamble", v=1)) and pool.disk.exists(kv_key("fact2", i=2))
