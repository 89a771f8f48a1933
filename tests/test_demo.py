"""`moekit demo --json`: the exactness check holds and the numbers obey their definitions."""

import json

from moekit.cli import main


def test_demo_json(capsys):
    assert main(["demo", "--json", "--seed", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["exactness"]["max_abs_diff"] < 1e-10
    assert report["exactness"]["grouped_matmuls"] <= 16 < report["exactness"]["naive_matmuls"]
    rows = {(r["batch"], r["capacity_factor"]): r for r in report["sweep"]}
    assert len(rows) == 16
    e, k = report["config"]["num_experts"], report["config"]["top_k"]
    assert rows[(1, None)]["imbalance"] == e / k and rows[(1, None)]["effective_sparsity"] == e / k
    for batch in (1, 8, 64, 512):
        assert rows[(batch, None)]["drop_rate"] == 0.0  # dropless loses nothing
        drops = [rows[(batch, cf)]["drop_rate"] for cf in (1.0, 1.25, 2.0)]
        assert drops == sorted(drops, reverse=True)  # more capacity never drops more
    touch = {r["batch"]: r for r in report["touch"]}
    assert touch[1]["measured"] == k and touch[512]["measured"] == e
    assert all(abs(r["measured"] / r["predicted"] - 1) < 0.1 for r in report["touch"])
