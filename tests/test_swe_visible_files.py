"""Nothing of a task's answer is visible inside the SWE sandbox (issue 32, point 2).

Every task's patch (pristine -> bugged) names the pristine code around each bug: a hunk's old side, its context
lines and its '-' lines in order. A host image can hold other copies of the projects the tasks are built from (a
vendored copy under /usr, say); a policy could then diff its way to the answer. Here a scanner runs INSIDE a sandbox
mounted as the env mounts it (the working copy at /repo, the runner venv read-only) and reads every regular file it
can see (but /proc, /sys, /dev and the working copy), looking for any hunk's old side as consecutive lines (trailing
whitespace ignored). It must find none, and it must find a planted copy (so the scan is not vacuous).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from comprl_jax.envs.swe import sandbox as sb
from comprl_jax.envs.swe import tasks as tasks_lib

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap missing: `make setup` installs it"
)

TASK_FILE = Path(tasks_lib.__file__).with_name("tasks.jsonl")
SCAN_LIMITS = sb.SandboxLimits(
    wall_s=120, cpu_s=120, memory_mb=2048, processes=16, file_mb=64, output_bytes=1 << 16
)


def all_needles() -> list[dict]:
    needles = []
    with open(TASK_FILE) as f:
        for line in f:
            task = json.loads(line)
            for i, lines in enumerate(tasks_lib.old_sides(task["patch"])):
                needles.append(
                    {"task": task["instance_id"], "project": task["project"], "hunk": i, "lines": lines}
                )
    return needles


# Runs inside the sandbox (the system python, standard library only). Index: each needle's longest line (the
# rarest, in practice) -> needles; a file is split into lines only when one of those lines is in it, and a hit is
# the whole block at that place.
SCANNER = r"""
import json, os, stat, sys, time
t0 = time.monotonic()
needles = json.load(open(sys.argv[1]))
blocks = [[l.encode("utf-8", "surrogateescape").rstrip() for l in n["lines"]] for n in needles]
index = {}
for k, b in enumerate(blocks):
    at = max(range(len(b)), key=lambda j: len(b[j]))
    index.setdefault(b[at], []).append((k, at))
keys = set(index)
skip = {"/proc", "/sys", "/dev", "/repo"}
files = size = unreadable = 0
hits, seen = [], set()
for root, dirs, names in os.walk("/"):
    dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip]
    for name in names:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            unreadable += 1
            continue
        files += 1
        size += len(data)
        lines = [l.rstrip() for l in data.split(b"\n")]
        common = keys.intersection(lines)
        if not common:
            continue
        for i, l in enumerate(lines):
            if l not in common:
                continue
            for k, at in index[l]:
                b = blocks[k]
                s = i - at
                if s >= 0 and lines[s : s + len(b)] == b:
                    hits.append([path, k])
json.dump({"files": files, "bytes": size, "unreadable": unreadable, "hits": hits,
           "seconds": time.monotonic() - t0}, open(sys.argv[2], "w"))
print("scanned", files, "files")
"""


def scan(tmp_path: Path, ro_paths: tuple[str, ...], needles: list[dict]) -> dict:
    work = tmp_path / "work"
    work.mkdir()
    (work / "scan.py").write_text(SCANNER)
    (work / "needles.json").write_text(json.dumps(needles))
    with sb.Sandbox(str(work), limits=SCAN_LIMITS, ro_paths=ro_paths) as box:
        r = box.run("python3 /repo/scan.py /repo/needles.json /repo/hits.json")
    assert r.ok and "scanned" in r.output, r.observation()
    out = json.loads((work / "hits.json").read_text())
    out["hits"] = [(path, needles[k]) for path, k in out["hits"]]
    return out


def test_hunks_are_read_as_their_old_side():
    patch = "--- a/x.py\n+++ b/x.py\n@@ -1,4 +1,3 @@\n a = 1\n-b = 2\n+b = 3\n \n c = 4\n"
    assert tasks_lib.old_sides(patch) == [["a = 1", "b = 2", "", "c = 4"]]


def test_no_task_answer_is_visible_in_the_sandbox(tmp_path):
    needles = all_needles()
    assert len({n["task"] for n in needles}) == sum(1 for _ in open(TASK_FILE)) >= 100
    runner = tasks_lib.runner_env()
    # A planted copy: one task's pristine hunk, indented the same, trailing blanks added, between other lines, in
    # a directory mounted like any read-only path: the scan must report it (and nothing outside it).
    planted = needles[0]
    vendored = tmp_path / "vendored" / planted["project"]
    vendored.mkdir(parents=True)
    body = "\n".join(line + ("  " if i % 2 else "") for i, line in enumerate(planted["lines"]))
    (vendored / "copy.py").write_text("# a vendored copy\nimport os\n" + body + "\n# end\n")
    out = scan(tmp_path, (str(runner), str(tmp_path / "vendored")), needles)
    # the scan saw the standard library, the runner's pytest and the plant
    assert out["files"] > 1000 and out["bytes"] > 20 << 20, out
    elsewhere = [(n["task"], p) for p, n in out["hits"] if not p.startswith(str(vendored) + "/")]
    unexpected = sorted(elsewhere)
    assert unexpected == [], f"{len(unexpected)} task hunks visible in the sandbox, e.g. {unexpected[:10]}"
    assert (str(vendored / "copy.py"), planted["task"]) in [(p, n["task"]) for p, n in out["hits"]]
    assert out["seconds"] < 60, out["seconds"]
