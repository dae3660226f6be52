"""bench/evolved_versions.py runs end to end on a tiny model: each version of each scene is one group."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))


def test_evolved_versions_bench_scores_a_group_per_scene_and_version(tiny_model_dir, tmp_path):
    import evolved_versions

    out = tmp_path / "versions.json"
    r = evolved_versions.main([str(tiny_model_dir), "--scenes", "3", "--group", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == r
    assert set(r) >= set(evolved_versions.VERSIONS)
    assert r["original"]["kinds"] == ["original"] and r["zoom"]["kinds"] == ["original+declutter+zoom"]
    for name in evolved_versions.VERSIONS:
        v = r[name]
        assert v["n"] == v["all"]["groups"] == 3 == v["small"]["groups"] + v["large"]["groups"]
        assert 0 <= v["all"]["acc50"] <= 100 and v["all"]["all_wrong"] + v["all"]["all_right"] <= 100
