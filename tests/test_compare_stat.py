"""launch/bench/compare_stat.py: the pre-registered statistic of compare_cpu.sh, one ``bench: "compare"`` line per
arm (issue 31 point 3), with hand-computed numbers on hand-built run directories."""

import importlib.util
import json
import math
import os
import sys

import pytest
from trainer_helpers import REPO

ENV = "comprl/HiddenRule-v0"


def _stat():
    spec = importlib.util.spec_from_file_location(
        "bench_compare_stat", os.path.join(REPO, "launch/bench/compare_stat.py")
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _run(root, method, seed, free, guided=None, actions=1.0, ev=None):
    """A run of 4 logged steps whose per-step free (and guided) success is given; steps 2, 3 are the second half."""
    d = root / f"{method}_s{seed}"
    d.mkdir()
    cfg = {"method": method, "experiment": "hidden_rule", "seed": seed, "env": {"tasks": [ENV]}}
    (d / "config.json").write_text(json.dumps(cfg))
    rows = []
    for step, f in enumerate(free):
        row = {"step": step, "success": f, "actions_per_episode": actions + step}
        if guided is not None:
            row |= {"success/free": f, "success/guided": guided[step]}
        rows.append(row)
    rows.append({"step": 3, "eval/success": 0.5})  # an eval-only row: skipped
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if ev is not None:
        entry = lambda s: {ENV: {"env_id": ENV, "split": "held-out seeds", "success": s, "episodes": 32}}  # noqa: E731
        (d / "eval.json").write_text(json.dumps({m: entry(s) for m, s in ev.items()}))


def test_one_compare_line_per_arm_with_the_preregistered_statistic(tmp_path):
    cs = _stat()
    # baseline: second-half means 0.3 and 0.5 -> mean 0.4, se = sd / sqrt(2) = 0.1414 / 1.414 = 0.1
    _run(tmp_path, "baseline", 0, [0.0, 0.1, 0.2, 0.4], ev={"without_exp": 0.25})
    _run(tmp_path, "baseline", 1, [0.0, 0.1, 0.4, 0.6], ev={"without_exp": 0.75})
    # complementary: free halves 0.6 and 0.8 -> 0.7 +- 0.1; guided halves 0.9 and 1.0 -> 0.95 +- 0.05
    _run(tmp_path, "complementary", 0, [0, 0, 0.5, 0.7], guided=[0, 0, 0.8, 1.0], ev={"with_exp": 1.0})
    _run(tmp_path, "complementary", 1, [0, 0, 0.8, 0.8], guided=[0, 0, 1.0, 1.0], ev={"with_exp": 0.5})
    rand = {
        "bench": "random_reference",
        "env": ENV,
        "seed": 0,
        "second_half": 0.125,
        "first_half": 0.1,
        "eval": 0.0,
    }
    (tmp_path / "random.jsonl").write_text(json.dumps(rand) + "\n")
    lines = {x["arm"]: x for x in cs.arm_lines(cs.collect(str(tmp_path)))}
    assert set(lines) == {"baseline", "complementary", "uniform_random"}
    b, c, r = lines["baseline"], lines["complementary"], lines["uniform_random"]
    for x in (b, c, r):
        assert x["bench"] == "compare" and x["env"] == ENV and x["statistic"] == "free_second_half"
    assert b["seeds"] == [0, 1] and math.isclose(b["mean"], 0.4) and math.isclose(b["se"], 0.1)
    assert math.isclose(c["mean"], 0.7) and math.isclose(c["se"], 0.1)
    g = c["secondary"]["guided_second_half"]
    assert math.isclose(g[0], 0.95) and math.isclose(g[1], 0.05) and g[2] == 2
    ev = b["secondary"]["eval_without_exp"]  # 0.25, 0.75 -> 0.5 +- 0.25
    assert math.isclose(ev[0], 0.5) and math.isclose(ev[1], 0.25)
    assert math.isclose(c["secondary"]["eval_with_exp"][0], 0.75)
    assert math.isclose(b["secondary"]["actions_second_half"][0], 3.5)  # steps 2, 3 log 3.0 and 4.0
    assert b["secondary"]["guided_second_half"] is None  # the baseline has no guided half
    assert r["seeds"] == [0] and r["mean"] == 0.125 and r["se"] is None  # one seed: no standard error
    json.dumps(list(lines.values()), allow_nan=False)  # strict JSON: no NaN
    (d,) = [x for x in cs.diff_lines(list(lines.values())) if x["arm"] == "complementary"]
    assert math.isclose(d["diff"], 0.3) and math.isclose(d["se"], math.sqrt(0.02))
    assert math.isclose(d["z"], 0.3 / math.sqrt(0.02))


def test_an_empty_root_names_the_flag(tmp_path):
    cs = _stat()
    with pytest.raises(SystemExit, match="no run directories with metrics.jsonl under --root="):
        cs.collect(str(tmp_path))
