"""HiCache through the engine: parity on / off under a small device pool, refits and other
weights never reuse KV from L2 / L3, a restart serves from L3, sleep frees the host tier."""

from __future__ import annotations

import os

import psutil
import pytest

GREEDY = {"temperature": 0, "max_new_tokens": 6}
POOL = 192          # device KV tokens: far below the working set of the conversations below
HICACHE = {"enable_hierarchical_cache": True, "hicache_ratio": 8.0}


@pytest.fixture(scope="module")
def paths():
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))


def _conversations(num: int, turns: int, engine,
                   samples: int = 1) -> list[list[tuple[list[int], list[float], int]]]:
    """``num`` conversations, round-robin, each turn resending its whole history plus its
    reply and a new user message (``samples`` times: later ones hit the device copy);
    per turn: output ids, logprobs, cached tokens of the first sample."""
    histories = [[(7 * c + i) % 200 + 3 for i in range(48)] for c in range(num)]
    results: list[list[tuple[list[int], list[float], int]]] = [[] for _ in range(num)]
    for turn in range(turns):
        for c in range(num):
            out, *others = [engine.generate(input_ids=histories[c], sampling_params=GREEDY,
                                             return_logprob=True) for _ in range(samples)]
            assert all(o["output_ids"] == out["output_ids"] for o in others)
            meta = out["meta_info"]
            results[c].append((out["output_ids"],
                               [lp for lp, _, _ in meta["output_token_logprobs"]],
                               meta["cached_tokens"]))
            histories[c] = histories[c] + out["output_ids"] + [
                (11 * turn + 5 * c + i) % 200 + 3 for i in range(10)]
    return results


def _logprobs(out: dict) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def _tiers(engine) -> dict:
    return engine.get_server_info()["hicache"]


@pytest.mark.parametrize("page_size,policy", [(1, "write_through"), (4, "write_through"),
                                              (1, "write_back"), (2, "write_through_selective")])
def test_outputs_identical_with_hicache_on_and_off(paths, make_engine, page_size, policy):
    flags = dict(max_total_tokens=POOL, debug_integrity=True, page_size=page_size)
    off = make_engine(paths[0], **flags)
    on = make_engine(paths[0], **flags, **HICACHE, hicache_write_policy=policy)
    # selective write-through copies a node at its second hit: a second sample gives it one
    samples = 2 if policy == "write_through_selective" else 1
    ref, got = _conversations(4, 4, off, samples), _conversations(4, 4, on, samples)
    for conv_ref, conv_got in zip(ref, got):
        for (ids_r, lps_r, _), (ids_g, lps_g, _) in zip(conv_ref, conv_got):
            assert ids_r == ids_g
            assert max(abs(a - b) for a, b in zip(lps_r, lps_g)) <= 1e-5
    tiers = _tiers(on)
    assert tiers["host_hit_tokens"] > 0, tiers          # the host tier was really used
    cached_on = sum(t[2] for conv in got for t in conv)
    cached_off = sum(t[2] for conv in ref for t in conv)
    assert cached_on > cached_off                       # ... and saved prefill


def test_flush_cache_empties_device_and_host_tiers(paths, make_engine):
    engine = make_engine(paths[0], max_total_tokens=POOL, **HICACHE)
    _conversations(3, 2, engine)
    assert _tiers(engine)["host_cached_tokens"] > 0
    assert engine.flush_cache()
    info = engine.get_server_info()
    assert info["kv_cached_tokens"] == 0 and info["hicache"]["host_cached_tokens"] == 0
    prompt = [(7 * 0 + i) % 200 + 3 for i in range(48)]
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 0


def _long_prompt(seed: int, n: int = 160) -> list[int]:
    return [(13 * i + seed) % 250 + 2 for i in range(n)]


def test_refit_never_reloads_older_kv_from_l2_or_l3(paths, make_engine, tmp_path):
    w1, w2 = paths
    flags = dict(max_total_tokens=POOL, debug_integrity=True,
                 hicache_storage_backend="file", hicache_storage_dir=str(tmp_path), **HICACHE)
    engine = make_engine(w1, **flags)
    prompt = _long_prompt(1)
    engine.generate(input_ids=prompt, sampling_params=GREEDY)
    again = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] >= 128          # it is cached under w1
    ok, msg = engine.update_weights_from_disk(w2, weight_version="w2")
    assert ok, msg
    before = _tiers(engine)
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True)
    assert out["meta_info"]["cached_tokens"] == 0
    after = _tiers(engine)
    assert after["storage_hit_tokens"] == before["storage_hit_tokens"]
    assert after["host_hit_tokens"] == before["host_hit_tokens"]
    fresh = make_engine(w2).generate(input_ids=prompt, sampling_params=GREEDY,
                                     return_logprob=True)
    assert out["output_ids"] == fresh["output_ids"]
    assert _logprobs(out) == pytest.approx(_logprobs(fresh), abs=1e-5)


def test_restart_serves_long_prefix_from_l3_and_other_weights_never_load_it(
        paths, make_engine, tmp_path):
    w1, w2 = paths
    flags = dict(max_total_tokens=POOL, debug_integrity=True,
                 hicache_storage_backend="file", hicache_storage_dir=str(tmp_path), **HICACHE)
    prompt = _long_prompt(2)
    first = make_engine(w1, **flags)
    ref = first.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True)
    first.shutdown()           # queued block writes reach the directory before it exits
    assert any(tmp_path.rglob("*.kv"))

    other = make_engine(w2, **flags)   # same directory, other weights
    out_other = other.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out_other["meta_info"]["cached_tokens"] == 0
    assert _tiers(other)["storage_hit_tokens"] == 0
    fresh_w2 = make_engine(w2).generate(input_ids=prompt, sampling_params=GREEDY)
    assert out_other["output_ids"] == fresh_w2["output_ids"]

    restarted = make_engine(w1, **flags)
    out = restarted.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True)
    block = 64
    assert out["meta_info"]["cached_tokens"] == (len(prompt) - 1) // block * block
    assert _tiers(restarted)["storage_hit_tokens"] == out["meta_info"]["cached_tokens"]
    assert out["output_ids"] == ref["output_ids"]
    assert _logprobs(out) == pytest.approx(_logprobs(ref), abs=1e-5)


def test_sleep_frees_the_host_tier(paths, make_engine):
    engine = make_engine(paths[0], scheduler_mode="process", max_total_tokens=16384,
                         enable_hierarchical_cache=True, hicache_ratio=16.0)
    engine.generate(input_ids=_long_prompt(3), sampling_params=GREEDY)
    info = engine.get_server_info()
    host_bytes = info["hicache"]["host_pool_bytes"]
    assert host_bytes >= 16 * info["kv_pool_bytes"] * 0.99
    proc = psutil.Process(engine.tm.host.pid)
    rss_before = proc.memory_info().rss
    res = engine.release_memory_occupation(["kv_cache"])
    rss_after = proc.memory_info().rss
    assert res["bytes_freed"] == info["kv_pool_bytes"] + host_bytes
    assert rss_before - rss_after >= 0.9 * host_bytes, (rss_before, rss_after, host_bytes)
    engine.resume_memory_occupation(["kv_cache"])
    out = engine.generate(input_ids=_long_prompt(3), sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 0      # the tiers came back empty


def test_flags_as_sglang_names_them(paths):
    from rollout_engine.compat.server_args import SGLANG_FLAGS
    from rollout_engine.config import EngineConfig

    config = EngineConfig.from_kwargs(
        model_path=paths[0], enable_hierarchical_cache=True, hicache_ratio=3.0,
        hicache_write_policy="write_back", hicache_storage_backend="file",
        hicache_storage_prefetch_policy="wait_complete", hicache_size=0)
    assert (config.hicache_ratio, config.hicache_write_policy) == (3.0, "write_back")
    assert SGLANG_FLAGS["enable_hierarchical_cache"].option_strings == (
        "--enable-hierarchical-cache", "--enable-hicache")
    for field, value in (("hicache_write_policy", "write_around"),
                         ("hicache_storage_prefetch_policy", "eager"),
                         ("hicache_storage_backend", "mooncake"),
                         ("hicache_ratio", 0.0)):
        with pytest.raises(ValueError, match=field):
            EngineConfig.from_kwargs(model_path=paths[0], enable_hierarchical_cache=True,
                                     **{field: value})
    with pytest.raises(ValueError, match="hicache_storage_backend"):
        EngineConfig.from_kwargs(model_path=paths[0], hicache_storage_backend="file")


def test_process_engine_writes_l3_before_it_exits(paths, make_engine, tmp_path):
    flags = dict(max_total_tokens=POOL, hicache_storage_backend="file",
                 hicache_storage_dir=str(tmp_path), **HICACHE)
    prompt = _long_prompt(4)
    child = make_engine(paths[0], scheduler_mode="process", **flags)
    ref = child.generate(input_ids=prompt, sampling_params=GREEDY)
    child.shutdown()                      # the child flushes its writer on Shutdown
    assert len(list(tmp_path.rglob("*.kv"))) == len(prompt) // 64
    out = make_engine(paths[0], **flags).generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 128
    assert out["output_ids"] == ref["output_ids"]


@pytest.mark.parametrize("flush_storage", [False, True])
def test_flush_cache_deletes_own_l3_blocks_only_by_flag(paths, make_engine, tmp_path,
                                                        flush_storage):
    from rollout_engine.memory.hicache.storage import FileStorage, block_keys

    foreign = block_keys(b"another engine", list(range(64)), 64, 1)[0]
    FileStorage(str(tmp_path), 1 << 20).set(foreign, b"their block")
    engine = make_engine(paths[0], max_total_tokens=POOL, hicache_storage_backend="file",
                         hicache_storage_dir=str(tmp_path), hicache_storage_flush=flush_storage,
                         **HICACHE)
    prompt = _long_prompt(5)
    engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert engine.flush_cache()
    names = {p.stem for p in tmp_path.rglob("*.kv")}
    assert foreign in names                            # never another engine's
    assert len(names) == (1 if flush_storage else 1 + len(prompt) // 64)
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == (0 if flush_storage else 128)


def test_the_file_tier_defaults_to_the_users_private_cache(paths, make_engine, tmp_path,
                                                           monkeypatch):
    from torch.utils.cpp_extension import get_default_build_root

    # the compiled kernels stay where they are (their default home follows XDG_CACHE_HOME too)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR",
                       os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    engine = make_engine(paths[0], max_total_tokens=POOL, hicache_storage_backend="file",
                         **HICACHE)
    engine.generate(input_ids=_long_prompt(6), sampling_params=GREEDY)
    engine.shutdown()          # queued block writes reach the directory before it returns
    default = tmp_path / "xdg" / "rollout_engine" / "hicache"
    assert len(list(default.rglob("*.kv"))) == 2
    assert default.stat().st_mode & 0o777 == 0o700


def test_a_storage_dir_others_may_write_is_refused_at_start(paths, make_engine, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(Exception, match="hicache_storage_dir") as e:
        make_engine(paths[0], max_total_tokens=POOL, hicache_storage_backend="file",
                    hicache_storage_dir=str(shared), **HICACHE)
    assert "chmod 700" in str(e.value)
    assert not any(shared.iterdir())
