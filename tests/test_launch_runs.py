"""launch/train.py and launch/evaluate.py on a real (tiny, MINI-sized) run: quiet logs and the end-of-run table
(issues 14.7, 16.10), re-running a finished run (16.6), resuming with a changed config (16.4).

One 2-step run is trained once, in two invocations, and shared; the other invocations resume or read it."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from trainer_helpers import REPO, cache_env, flags

pytestmark = pytest.mark.slow

TINY = "--config=configs/minihack_room.py:tiny"
INFO_LINE = re.compile(r"^I\d{4} ")  # absl's INFO prefix: I<mmdd> <time> <thread> <file>:<line>]


@pytest.fixture(scope="session")  # once per xdist worker even when other modules run between its tests
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("xla_cache")  # later invocations reuse the first one's compiled programs
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "",
        "TOKENIZERS_PARALLELISM": "false",
        **cache_env(cache),
    }


def _launch(script, env, *args):
    return subprocess.run(
        [sys.executable, script, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )


def _train(env, workdir, *extra, **over):
    return _launch("launch/train.py", env, TINY, f"--workdir={workdir}", *flags(**over), *extra)


def _rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")  # once per xdist worker even when other modules run between its tests
def finished(tmp_path_factory, env):
    """One 2-step run, trained in two invocations: step 0 (``--stop_after=1``), then step 1 after a refused and an
    allowed resume with a changed config (16.4). Returns the run directory and the three invocations' results."""
    work = tmp_path_factory.mktemp("launch") / "run"
    first = _train(env, work, "--stop_after=1")
    assert first.returncode == 0, first.stderr[-3000:]
    old_config = json.loads((work / "config.json").read_text())
    # seed: a change that compiles nothing new (train.steps may change freely; it is not one here)
    refused = _train(env, work, seed=7)
    allowed = _train(env, work, "--allow_config_change", seed=7)
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    return work, {"first": first, "refused": refused, "allowed": allowed, "old_config": old_config}


def _assert_eval_table(lines):
    """The held-out table: a header over both modes, their columns, one row for the env (split column or not)."""
    assert lines[0].startswith("held-out eval ") and lines[0].index("with experience") < lines[0].index(
        "without"
    )
    assert [c.split() for c in lines[1].split("|")][-2:] == [
        ["success", "score", "actions", "tasks", "episodes", "infra"]
    ] * 2
    assert len(lines) == 3 and lines[2].startswith("comprl/MiniHack-Room-Ultimate-5x5-v0 ")
    assert len({len(line) for line in lines[1:]}) == 1  # aligned


# comprl_jax's own INFO lines (the trainer's, the run state's "resumed from step N"): the only ones a run prints
OWN_LOGGERS = ("trainer.py", "run_state.py")


def _ours(line: str) -> bool:
    return any(f" {m}:" in line for m in OWN_LOGGERS)


def test_logs_are_quiet(finished):
    """14.7: no library INFO lines (Orbax used to print hundreds); the progress bar is what stderr holds."""
    _, res = finished
    for r in (res["first"], res["allowed"]):
        assert not [line for line in r.stderr.splitlines() if INFO_LINE.match(line) and not _ours(line)]
        assert "minihack_room:" in r.stderr and "step/s" in r.stderr
    assert not [line for line in res["first"].stderr.splitlines() if INFO_LINE.match(line)]


def test_end_of_run_summary_and_eval_table(finished):
    work, res = finished
    rows = _rows(work)
    first = res["first"].stdout.splitlines()
    assert first == [
        f"step 1: success {rows[0]['success']:.3f} (guided {rows[0]['success/guided']:.3f}, free "
        f"{rows[0]['success/free']:.3f}), actions/episode {rows[0]['actions_per_episode']:.2f}, bank size "
        f"{int(rows[0]['bank/size'])} (last recorded at step 0)"
    ]  # not finished: no evaluation yet
    out = res["allowed"].stdout.splitlines()
    assert out[1].startswith(f"step 2: success {rows[1]['success']:.3f} ")
    assert out[1].endswith(f"bank size {int(rows[1]['bank/size'])} (last recorded at step 1)")
    _assert_eval_table(out[2:])
    assert (work / "curves.png").stat().st_size > 1000


def test_resume_with_a_changed_config(finished):
    work, res = finished
    assert res["refused"].returncode == 2
    err = res["refused"].stderr.splitlines()
    assert err[0] == f"error: --workdir={work} holds a run at step 1 with another config: seed 0 -> 7"
    assert err[1].startswith("run with that run's flags, pass --allow_config_change")
    assert res["allowed"].stdout.splitlines()[0] == (
        f"config changed at step 1: seed 0 -> 7 (the old config is kept in {work}/config.1.json)"
    )
    assert json.loads((work / "config.1.json").read_text()) == res["old_config"]
    assert json.loads((work / "config.json").read_text())["seed"] == 7
    rows = _rows(work)
    assert [row["step"] for row in rows] == [0, 1]
    assert [row.get("config_changed") for row in rows] == [None, 1.0]


def test_rerunning_a_finished_run_says_nothing_to_do(finished, env):
    work, _ = finished
    rows = _rows(work)
    r = _train(env, work, seed=7)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.splitlines()
    assert out[0] == "already at step 2 (train.steps=2); nothing to do"
    # the run's last recorded metrics and its real bank size (it used to print "success nan, bank size 0")
    assert out[1].startswith(f"step 2: success {rows[-1]['success']:.3f} ")
    assert out[1].endswith(f"bank size {int(rows[-1]['bank/size'])} (last recorded at step 1)")
    assert _rows(work) == rows
    assert "resumed from step 2" in r.stderr  # comprl_jax's own INFO lines stay
    assert not [line for line in r.stderr.splitlines() if INFO_LINE.match(line) and not _ours(line)]
    # --verbosity=0 gives the libraries' INFO logs back (Orbax's restore lines among them)
    r = _train(env, work, "--verbosity=0", seed=7)
    assert r.returncode == 0
    lib = [line for line in r.stderr.splitlines() if INFO_LINE.match(line) and not _ours(line)]
    assert any("checkpoint" in line.lower() for line in lib), r.stderr[-3000:]


def test_evaluate_prints_the_table_and_writes_eval_json(finished, env, tmp_path):
    work = tmp_path / "run"
    shutil.copytree(finished[0], work)
    (work / "eval.json").unlink()
    r = _launch("launch/evaluate.py", env, f"--workdir={work}", "--tasks=1")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.splitlines()
    assert out[0] == "step 2, held-out tasks per env and split in the tasks column:"
    _assert_eval_table(out[1:-1])
    assert out[-1] == f"written: {work}/eval.json"
    ev = json.loads((work / "eval.json").read_text())
    assert set(ev) == {"with_exp", "without_exp"}
    r = _launch("launch/evaluate.py", env, f"--workdir={tmp_path / 'nope'}")
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == f"error: {tmp_path / 'nope'}/config.json not found"
