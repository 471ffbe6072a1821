"""The file storage tier: atomic whole blocks, damaged files read as misses, bounded size,
keys that separate models / weights / prefixes, several writers on one directory, and a
directory no other user can write."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from rollout_engine.memory.hicache import storage
from rollout_engine.memory.hicache.storage import (
    FileStorage,
    StorageWriter,
    block_keys,
    create_storage,
    default_storage_dir,
)


def test_set_get_exists_round_trip(tmp_path):
    store = FileStorage(str(tmp_path), max_bytes=1 << 20)
    key = block_keys(b"m", list(range(8)), 8, 1)[0]
    assert not store.exists(key) and store.get(key) is None
    assert store.set(key, b"abc" * 10)
    assert store.exists(key) and store.get(key) == b"abc" * 10
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_damaged_block_is_a_miss_and_removed(tmp_path):
    store = FileStorage(str(tmp_path), max_bytes=1 << 20)
    key = block_keys(b"m", list(range(8)), 8, 1)[0]
    store.set(key, bytes(range(200)))
    (path,) = tmp_path.rglob("*.kv")
    raw = path.read_bytes()
    path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))        # one flipped bit
    assert store.get(key) is None and not path.exists()
    store.set(key, bytes(range(200)))
    path.write_bytes(path.read_bytes()[:50])                  # truncated
    assert store.get(key) is None


def test_size_bound_evicts_least_recently_used(tmp_path):
    store = FileStorage(str(tmp_path), max_bytes=10_000)
    keys = block_keys(b"m", list(range(64)), 4, 16)
    for i, key in enumerate(keys):
        store.set(key, bytes([i]) * 1000)
        os.utime(next(tmp_path.rglob(key + ".kv")), (i, i))  # a distinct recency each
    total = sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))
    assert total <= 10_000
    assert store.get(keys[-1]) == bytes([15]) * 1000 and store.get(keys[0]) is None


def test_keys_depend_on_identity_and_whole_prefix():
    tokens = list(range(32))
    a = block_keys(b"model-a|weights-1", tokens, 8, 4)
    assert len(a) == 4 and len(set(a)) == 4
    assert block_keys(b"model-a|weights-2", tokens, 8, 4)[0] != a[0]
    other = [99] + tokens[1:]                                  # first token differs
    assert all(x != y for x, y in zip(block_keys(b"model-a|weights-1", other, 8, 4), a))
    assert block_keys(b"model-a|weights-1", tokens[:20], 8, 4) == a[:2]   # whole blocks only


def test_concurrent_writers_never_expose_a_torn_block(tmp_path):
    stores = [FileStorage(str(tmp_path), max_bytes=1 << 24) for _ in range(2)]
    keys = block_keys(b"m", list(range(256)), 4, 64)
    payload = {k: os.urandom(4096) for k in keys}
    bad: list[str] = []

    def write(store):
        for k in keys:
            store.set(k, payload[k])

    def read():
        for _ in range(3):
            for k in keys:
                data = stores[0].get(k)
                if data is not None and data != payload[k]:
                    bad.append(k)

    threads = [threading.Thread(target=write, args=(s,)) for s in stores]
    threads.append(threading.Thread(target=read))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    assert all(stores[1].get(k) == payload[k] for k in keys)


def test_writer_flush_waits_for_every_block(tmp_path):
    store = FileStorage(str(tmp_path), max_bytes=1 << 20)
    writer = StorageWriter(store)
    keys = block_keys(b"m", list(range(64)), 4, 16)
    for k in keys:
        writer.submit(k, b"x" * 100)
    writer.flush()
    assert all(store.exists(k) for k in keys)
    writer.close()


def test_unknown_backend_is_refused(tmp_path):
    assert create_storage(None, str(tmp_path), 1) is None
    with pytest.raises(ValueError, match="hicache_storage_backend"):
        create_storage("mooncake", str(tmp_path), 1 << 20)


# -- a private directory -----------------------------------------------------------------------
def test_the_directory_and_its_blocks_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        store = FileStorage(str(tmp_path / "l3"), max_bytes=1 << 20)
        key = block_keys(b"m", list(range(8)), 8, 1)[0]
        assert store.set(key, b"kv")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "l3").stat().st_mode) == 0o700
    for path in (tmp_path / "l3").rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777], ids=["0777", "0770", "1777"])
def test_a_directory_others_may_write_is_refused(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(ValueError, match="hicache_storage_dir.*chmod 700"):
        FileStorage(str(shared), max_bytes=1 << 20)


def test_a_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    me = os.getuid()
    # tests may run as root, who could chown it: seen from another uid, it is another user's
    monkeypatch.setattr(storage.os, "getuid", lambda: me + 1)
    with pytest.raises(ValueError, match=f"hicache_storage_dir.*owned by uid {me}"):
        FileStorage(str(theirs), max_bytes=1 << 20)
    link = tmp_path / "link"
    link.symlink_to(theirs)
    with pytest.raises(ValueError, match="hicache_storage_dir"):
        FileStorage(str(link), max_bytes=1 << 20)


def test_a_block_under_another_key_is_a_miss(tmp_path):
    store = FileStorage(str(tmp_path), max_bytes=1 << 20)
    a, b = block_keys(b"m", list(range(16)), 8, 2)
    store.set(a, b"the KV of a")
    src = next(tmp_path.rglob(a + ".kv"))
    dst = tmp_path / b[:2] / (b + ".kv")
    dst.parent.mkdir(mode=0o700, exist_ok=True)
    dst.write_bytes(src.read_bytes())        # a valid CRC, the wrong key
    assert store.get(b) is None and not dst.exists()
    assert store.get(a) == b"the KV of a"


def test_the_default_directory_is_the_users_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", "/home/someone")
    assert default_storage_dir() == "/home/someone/.cache/rollout_engine/hicache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    store = create_storage("file", None, 1 << 20)
    assert store.directory == str(tmp_path / "xdg" / "rollout_engine" / "hicache")
    assert stat.S_IMODE(os.stat(store.directory).st_mode) == 0o700
