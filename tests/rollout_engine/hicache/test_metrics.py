"""/metrics shows the hierarchical cache's counters when get_server_info reports them."""

from __future__ import annotations

from rollout_engine.entrypoints.metrics import Metrics


def _info(hicache):
    return {"max_total_num_tokens": 100, "kv_free_tokens": 50, "stats": {},
            "weight_version": "w", "hicache": hicache}


def test_hicache_counters_rendered():
    tiers = {"device_hit_tokens": 10, "host_hit_tokens": 20, "storage_hit_tokens": 30,
             "bytes_to_host": 4096, "bytes_to_device": 2048, "load_seconds": 0.5,
             "storage_bytes_read": 7, "host_cached_tokens": 64, "host_total_tokens": 128}
    text = Metrics().render(_info(tiers), alive=True)
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    for name, value in (("hicache_host_hit_tokens_total", 20),
                        ("hicache_storage_hit_tokens_total", 30),
                        ("hicache_bytes_to_device_total", 2048),
                        ("hicache_load_seconds_total", 0.5),
                        ("hicache_storage_bytes_read_total", 7),
                        ("hicache_host_total_tokens", 128)):
        assert float(values[f"rollout_engine_{name}"]) == value, name
    assert "# TYPE rollout_engine_hicache_host_hit_tokens_total counter" in text


def test_no_hicache_no_counters():
    assert "hicache" not in Metrics().render(_info(None), alive=True)
