"""The KV pool's shared Redis tier (issue 31), against a real redis-server on loopback:
write-through, reads on a local miss from another machine's pool, deletes, and outages that
read as misses and log one line when they start and one when they end."""

import logging
import os
import time

import pytest
import torch

from inferscale.kv.pool import FactKV, KVPool, kv_key
from inferscale.kv.quant import quantize
from inferscale.kv.remote import RedisTier, redacted, redis_key


def fact(n: int, seed: int) -> FactKV:
    g = torch.Generator().manual_seed(seed)
    return FactKV(torch.randn(3, n, 2, 64, generator=g), torch.randn(3, n, 2, 64, generator=g), tuple(range(n)))


def two_machines(tmp_path, url: str) -> tuple[KVPool, KVPool]:
    """Two pools with data dirs of their own (two machines) over one Redis."""
    return (KVPool(tmp_path / "a" / "kv", "cpu", 1 << 30, redis_url=url),
            KVPool(tmp_path / "b" / "kv", "cpu", 1 << 30, redis_url=url))


def test_an_entry_written_on_one_machine_is_read_on_another(redis_server, tmp_path):
    a, b = two_machines(tmp_path, redis_server["url"])
    dense, key = fact(7, 0), kv_key("f1", n=1)
    q = quantize(dense.keys, dense.values, "int4", token_ids=dense.token_ids)
    qkey = kv_key("f1", n=1, store="int4")
    a.put(key, dense)
    a.put(qkey, q)
    assert b.tier(key) == "redis" and b.contains(key) and not (tmp_path / "b" / "kv" / "f1").exists()
    assert b.tiers([key, kv_key("f2", n=1), qkey]) == ["redis", None, "redis"]
    lookups = []
    b.remote.present = lambda keys, real=b.remote.present: lookups.append(list(keys)) or real(lookups[-1])
    assert b.present([key, kv_key("f2", n=1), qkey]) == {key, qkey} and len(lookups) == 1  # one round trip
    assert a.present([key, kv_key("f2", n=1)]) == {key}  # on its own disk
    del b.remote.present
    assert b.token_ids(key) == dense.token_ids
    got = b.get(key)
    assert torch.equal(got.keys, dense.keys) and torch.equal(got.values, dense.values)
    assert b.tier(key) == "device"  # kept in memory, not written to B's disk
    assert not (tmp_path / "b" / "kv" / "f1").exists()
    got_q = b.get(qkey)
    assert torch.equal(got_q.keys, q.keys) and torch.equal(got_q.values, q.values)
    assert b.stats["redis_hits"] == 2 and b.stats["writes"] == 0  # nothing encoded or written there
    assert a.remote.stats["writes"] == 2
    bad = kv_key("f3", n=1)
    import redis

    redis.Redis.from_url(redis_server["url"]).set(redis_key(bad), b"garbage")  # corrupt, or another program's
    assert b.tier(bad) == "redis" and b.get(bad) is None and b.tier(bad) is None  # deleted: encoded again


def test_deletes_reach_redis_and_other_keys_are_left_alone(redis_server, tmp_path):
    import redis

    a, b = two_machines(tmp_path, redis_server["url"])
    client = redis.Redis.from_url(redis_server["url"])
    client.set("someone-elses-key", b"keep")
    keys = [kv_key("f1", n=i) for i in range(3)] + [kv_key("f2", n=0)]
    for i, key in enumerate(keys):
        a.put(key, fact(4, i))
    a.invalidate_owner("f1")  # a fact updated or deleted: every variant, every tier
    assert b.tiers(keys) == [None, None, None, "redis"]
    a.remove(keys[3])
    assert b.tier(keys[3]) is None
    a.put(keys[0], fact(4, 0))
    a.clear()
    assert b.tier(keys[0]) is None and client.get("someone-elses-key") == b"keep"
    assert redis_key(keys[0]).startswith("inferscale:kv:{f1}/")  # one hash slot per fact (Redis Cluster)


def test_a_redis_outage_reads_as_misses_logs_twice_and_loses_nothing_local(redis_server, tmp_path, caplog,
                                                                           monkeypatch):
    monkeypatch.setattr(RedisTier, "RETRY_S", 0.5)
    a, b = two_machines(tmp_path, redis_server["url"])
    before, during = kv_key("f1", n=1), kv_key("f2", n=1)
    a.put(before, fact(5, 1))
    redis_server["kill"]()
    caplog.set_level(logging.WARNING, logger="inferscale.kv.remote")
    t0 = time.monotonic()
    for _ in range(20):  # traffic during the outage: misses, never errors, and no wait past the first
        assert b.get(before) is None and b.tier(before) is None
    a.put(during, fact(5, 2))  # an encode during the outage: on A's disk, skipped in Redis
    assert time.monotonic() - t0 < 5
    assert a.tier(during) == "device" and a.disk.exists(during)
    assert torch.equal(KVPool(tmp_path / "a" / "kv", "cpu", 1 << 30).get(during).keys, fact(5, 2).keys)
    down = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(down) == 2 and {r.name for r in down} == {"inferscale.kv.remote"}  # one per pool's tier
    assert b.remote.available is False and b.remote.stats["errors"] >= 1
    redis_server["start"]()  # back, empty (no persistence: a cache)
    time.sleep(0.6)
    assert b.tier(before) is None  # the entry is gone with the old Redis: a miss, re-encoded on use
    a.put(before, fact(5, 1))
    assert b.tier(before) == "redis" and torch.equal(b.get(before).keys, fact(5, 1).keys)
    back = [r for r in caplog.records if "answers again after" in r.getMessage()]
    assert len(back) == 2 and b.remote.available
    assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 2  # no line per failed call


def test_a_memory_deleted_while_redis_is_away_is_deleted_there_when_it_is_back(redis_server, tmp_path,
                                                                               monkeypatch):
    import signal

    import redis

    monkeypatch.setattr(RedisTier, "RETRY_S", 0.5)
    a, b = two_machines(tmp_path, redis_server["url"])
    gone, kept = kv_key("f1", n=1), kv_key("f2", n=1)
    a.put(gone, fact(5, 1))
    a.put(kept, fact(5, 2))
    admin = redis.Redis.from_url(redis_server["url"])
    os.kill(redis_server["proc"].pid, signal.SIGSTOP)  # away (a partition), its data kept
    try:
        a.invalidate_owner("f1")  # the memory is deleted meanwhile: the Redis delete times out
        assert not a.remote.available and a.tier(gone) is None
    finally:
        os.kill(redis_server["proc"].pid, signal.SIGCONT)
    assert admin.exists(redis_key(gone)) == 1  # still there while nobody asked
    time.sleep(0.6)
    assert a.tier(kept) == "device" and a.tier(kv_key("f3", n=1)) is None  # a call reaches Redis again ...
    assert admin.exists(redis_key(gone)) == 0 and admin.exists(redis_key(kept)) == 1  # ... and the delete is done
    assert b.tier(gone) is None and b.tier(kept) == "redis"


def test_a_delete_redis_missed_is_done_by_the_next_pool_over_the_folder_after_a_close(redis_server, tmp_path,
                                                                                       monkeypatch):
    import signal

    import redis

    monkeypatch.setattr(RedisTier, "RETRY_S", 0.5)
    url = redis_server["url"]
    first = KVPool.shared(tmp_path / "kv", "cpu", 1 << 30, redis_url=url)
    gone, kept = kv_key("f1", n=1), kv_key("f2", n=1)
    first.put(gone, fact(5, 1))
    first.put(kept, fact(5, 2))
    admin = redis.Redis.from_url(url)
    os.kill(redis_server["proc"].pid, signal.SIGSTOP)
    try:
        first.invalidate_owner("f1")  # deleted during the outage ...
        first.release()  # ... and the memory closed before Redis is back (a process exiting, too)
    finally:
        os.kill(redis_server["proc"].pid, signal.SIGCONT)
    assert admin.exists(redis_key(gone)) == 1
    pending = list((tmp_path / "kv").glob(".redis-pending-*"))
    assert len(pending) == 1 and "f1" in pending[0].read_text() and "s3cret" not in pending[0].name
    reopened = KVPool.shared(tmp_path / "kv", "cpu", 1 << 30, redis_url=url)  # a new pool: nothing in memory
    assert reopened is not first
    # opening it did the kept delete (before any read could see the deleted memory's KV)
    assert admin.exists(redis_key(gone)) == 0 and admin.exists(redis_key(kept)) == 1
    assert pending[0].read_text() == ""
    reopened.release()


@pytest.mark.parametrize("url,says", [
    ("http://user:s3cret@host:6379", "looks like redis://host:6379/0"),
    ("redis://host:port/0", "port is a number from 1 to 65535"),
    ("redis://host:99999/0", "port is a number from 1 to 65535"),
    ("  redis://host:6379/0", "no spaces around it"),
    ("redis://host:6379/abc", "path is a database number"),
    ("unix://", "looks like redis://"),
    ("redis://:s3cret@host:6379/0?foo=bar", "redis-py cannot use"),
    ("redis://host:6379/0?socket_timeout=abc&password=s3cret", "redis-py cannot use"),
])
def test_bad_urls_are_refused_and_passwords_never_printed(tmp_path, url, says):
    from inferscale.config import MemoryConfig

    with pytest.raises(ValueError, match=says) as caught:
        MemoryConfig(data_dir=tmp_path, kv_redis_url=url)
    assert "s3cret" not in str(caught.value) and "kv_redis_url: kv_redis_url" not in str(caught.value)
    with pytest.raises(ValueError, match=f"kv_redis_url: .*{says}"):
        RedisTier(url)


def test_passwords_are_redacted_wherever_a_url_is_shown(tmp_path):
    from inferscale.config import MemoryConfig

    assert redacted("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert redacted("unix:///run/redis.sock?db=1&password=s3cret") == "unix:///run/redis.sock?db=1&password=***"
    assert MemoryConfig(data_dir=tmp_path, kv_redis_url="").kv_redis_url is None
    url = "redis://:s3cret@127.0.0.1:6390/0"
    KVPool.shared(tmp_path / "kv", "cpu", 1 << 20, disk_budget_bytes=4 << 20, redis_url=url)
    with pytest.raises(ValueError, match="already open in this process") as caught:
        KVPool.shared(tmp_path / "kv", "cpu", 1 << 20, disk_budget_bytes=2 << 20, redis_url=url)
    assert "s3cret" not in str(caught.value) and "redis://:***@127.0.0.1:6390/0" in str(caught.value)


def test_an_error_redis_answers_fails_one_call_and_keeps_the_tier_up(redis_server, tmp_path, caplog):
    """Redis full under ``noeviction`` refuses writes (OOM) but still serves reads: the tier
    stays up, the refused entry stays local, and the log says so once."""
    import redis

    caplog.set_level(logging.WARNING, logger="inferscale.kv.remote")
    a, b = two_machines(tmp_path, redis_server["url"])
    small = kv_key("small", n=1)
    a.put(small, fact(2, 0))
    admin = redis.Redis.from_url(redis_server["url"])
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)  # past it already: every write is refused, reads still served
    try:
        for i in range(3):
            a.put(kv_key(f"big{i}", n=1), fact(40, i))
        assert a.remote.available and b.tier(small) == "redis" and b.get(small) is not None
        assert a.tier(kv_key("big0", n=1)) == "device" and b.tier(kv_key("big0", n=1)) is None
    finally:
        admin.config_set("maxmemory", 0)
        admin.config_set("maxmemory-policy", "noeviction")
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "answered an error while writing" in m and "maxmemory" in m]) == 1
    assert not [m for m in said if "unreachable" in m or "is failing" in m]


def test_a_redis_that_never_answered_is_an_outage_from_the_start(tmp_path, unused_port, caplog):
    caplog.set_level(logging.WARNING, logger="inferscale.kv.remote")
    pool = KVPool(tmp_path / "kv", "cpu", 1 << 30, redis_url=f"redis://127.0.0.1:{unused_port}/0")
    key = kv_key("f1", n=1)
    pool.put(key, fact(3, 0))
    assert pool.tier(key) == "device" and pool.disk.exists(key) and pool.remote.stats["writes"] == 0
    assert pool.tier(kv_key("f9", n=1)) is None
    assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1


FACTS = ["I live in Lisbon and work as a nurse.", "My dog is called Rex.", "I play the cello on Sundays.",
         "My sister Ana lives in Porto.", "I am allergic to peanuts.", "I drive a red Fiat."]


def test_two_machines_share_kv_through_one_redis_and_survive_it_going_away(postgres_url, chroma, redis_server,
                                                                           tmp_path, monkeypatch):
    """Two deployments with data dirs of their own (two machines) over one Chroma server, one
    PostgreSQL and one Redis: memories encoded on the first are injected on the second from
    Redis with zero encodes there; Redis killed mid-traffic, every request still succeeds
    (the memories come as text, or from KV the second machine holds), nothing is lost."""
    from inferscale import Memory

    monkeypatch.setattr(RedisTier, "RETRY_S", 0.5)
    settings = dict(dtype="float32", context_window=2, database_url=postgres_url, chroma_url=chroma["url"],
                    kv_redis_url=redis_server["url"], max_model_len=4096, kv_cache_memory_bytes=1 << 30)
    with Memory(data_dir=tmp_path / "first", **settings) as first:
        for text in FACTS:
            first.add(text, user_id="alice", infer=False)
        assert first.wait_for_kv(timeout=600)
        assert first.kv_stats()["redis_writes"] >= len(FACTS)  # each fact's KV written through (and the preamble)
        local = first.generate("Where do I live?", user_id="alice", k=len(FACTS), mode="inject", max_tokens=8)
        assert set(local.kv_sources.values()) <= {"device", "disk"} and local.num_injected_tokens > 0
    with Memory(data_dir=tmp_path / "second", **settings) as second:
        g = second.generate("Where do I live?", user_id="alice", k=len(FACTS), mode="inject", max_tokens=8)
        assert g.num_injected_tokens == local.num_injected_tokens and not g.text_memory_ids
        assert set(g.kv_sources.values()) == {"redis"}, g.kv_sources
        assert g.text == local.text  # the same KV bytes, injected on another machine: the same greedy answer
        stats = second.kv_stats()
        assert stats["writes"] == 0, "the second machine encoded nothing"
        assert stats["served_redis"] == len(FACTS) and stats["served_text"] == 0  # what /metrics counts as hits
        assert not any((tmp_path / "second" / "kv").glob("*/*.safetensors")), "nor wrote KV to its disk"

        redis_server["kill"]()  # mid-traffic
        answers = [second.generate(q, user_id="alice", k=len(FACTS), mode="inject", max_tokens=8)
                   for q in ("What is my dog called?", "What instrument do I play?", "Where does my sister live?")]
        assert all(a.text.strip() and a.finish_reason in ("stop", "length") for a in answers)
        # the front's own tiers hold nothing, so the memories came as text, saying why, queued to be encoded here
        assert set(answers[0].kv_sources.values()) == {"text: Redis unavailable"}, answers[0].kv_sources
        assert second.kv_stats()["redis_up"] == 0
        assert sorted(r["memory"] for r in second.get_all(user_id="alice")["results"]) == sorted(FACTS)


def test_a_redis_cluster_is_found_from_one_node_and_shares_entries(redis_cluster, tmp_path):
    """Given any node's URL, the tier detects the cluster (``INFO cluster``) and uses
    redis-py's ``RedisCluster``: entries spread over the nodes' slots, a fact's variants in one
    slot (hash tag), lookups pipelined across nodes, deletes per owner."""
    from redis.cluster import RedisCluster

    url = redis_cluster["url"].replace("/0", "")  # a cluster has database 0 only
    a = KVPool(tmp_path / "a" / "kv", "cpu", 1 << 30, redis_url=url)
    b = KVPool(tmp_path / "b" / "kv", "cpu", 1 << 30, redis_url=url)
    keys = [kv_key(f"fact{i}", n=j) for i in range(12) for j in range(2)]
    for i, key in enumerate(keys):
        a.put(key, fact(3, i))
    assert isinstance(a.remote._client, RedisCluster)
    assert b.tiers(keys) == ["redis"] * len(keys)
    assert torch.equal(b.get(keys[5]).keys, fact(3, 5).keys)
    client = RedisCluster.from_url(url)
    slots = {client.keyslot(redis_key(k)) for k in keys}
    nodes = {client.get_node_from_key(redis_key(k)).port for k in keys}
    assert len(slots) == 12 and len(nodes) > 1  # one slot per fact, facts on several nodes
    a.invalidate_owner("fact3")
    assert b.tiers([kv_key("fact3", n=0), kv_key("fact3", n=1), kv_key("fact4", n=0)]) == [None, None, "redis"]
    a.clear()
    assert b.tiers(keys[6:]) == [None] * (len(keys) - 6)
    # what b read into its memory counts only while the connector could read it too (disk or Redis)
    assert b.tier(keys[5]) is None and b.was_evicted(keys[5])
