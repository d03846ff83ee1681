"""Builds SWE-Lite's task file (issue 32 point 1): procedural bugs in the pinned projects, validated in the sandbox.

  .venv/bin/python launch/make_swe_tasks.py                       # all projects -> comprl_jax/envs/swe/tasks.jsonl
  .venv/bin/python launch/make_swe_tasks.py --projects=inflection --quota_scale=0.1 --out=/tmp/t.jsonl

Deterministic given the pinned sdists (comprl_jax/envs/swe/projects.py), the runner's pytest and --seed: the same
command writes the same lines (tests/test_swe_tasks.py rebuilds a sample of the shipped file). Prints one JSON line
per project (``bench: "swe_tasks"``: tasks, candidates tried, pristine tests, seconds) and one with the counts per
bug kind, the figures of WORKSPACE "SWE-Lite".
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from comprl_jax.envs.swe import env as swe_env
from comprl_jax.envs.swe import projects, tasks

_OUT = flags.DEFINE_string("out", str(swe_env.TASK_FILE), "where the JSONL goes")
_SEED = flags.DEFINE_integer("seed", 0, "orders each project's candidate bugs")
_PROJECTS = flags.DEFINE_list("projects", [], "project names (default: every pinned project)")
_QUOTA_SCALE = flags.DEFINE_float("quota_scale", 1.0, "multiplies projects.QUOTAS")
_WORKERS = flags.DEFINE_integer("workers", 2, "candidates validated at once")


def main(argv):
    del argv
    chosen = [p for p in projects.PROJECTS if not _PROJECTS.value or p.name in _PROJECTS.value]
    unknown = set(_PROJECTS.value) - {p.name for p in projects.PROJECTS}
    if unknown:
        raise SystemExit(f"--projects: {sorted(unknown)} not pinned in comprl_jax/envs/swe/projects.py")
    out = []
    for p in chosen:
        t0 = time.perf_counter()
        quota = max(1, round(projects.QUOTAS[p.name] * _QUOTA_SCALE.value))
        stats = {}
        got = tasks.build_project(
            p,
            seed=_SEED.value,
            quota=quota,
            workers=_WORKERS.value,
            log=lambda s: print(s, flush=True),
            stats=stats,
        )
        out += got
        line = {"bench": "swe_tasks", "project": p.key, "split": p.split, "tasks": len(got), "quota": quota}
        line |= stats | {"wall_s": round(time.perf_counter() - t0, 1)}
        print(json.dumps(line), flush=True)
    out = tasks.splits(out, projects.PROJECTS)
    tmp = _OUT.value + ".tmp"
    with open(tmp, "w") as f:
        for t in out:
            f.write(json.dumps(t, sort_keys=True) + "\n")
    os.replace(tmp, _OUT.value)
    kinds = collections.Counter(t["kind"] for t in out)
    splits = collections.Counter(
        "eval"
        if t["split"] == "eval"
        else "same_project_eval"
        if t["same_project_split"] == "eval"
        else "train"
        for t in out
    )
    print(json.dumps({"bench": "swe_tasks_total", "tasks": len(out), "kinds": dict(sorted(kinds.items())),
                      "splits": dict(sorted(splits.items())), "out": _OUT.value}))  # fmt: skip


if __name__ == "__main__":
    app.run(main)
