"""launch/train.py as a user meets it (issue 16.2-16.5): every mistake ends in two lines (what is wrong, what to do)
with a non-zero exit and no half-made run directory; --print_config lists the final config with comments.

All of these fail before any model loads (a few seconds each, most well under one)."""

import json
import os
import subprocess
import sys

import pytest
from trainer_helpers import REPO

from launch import common as lu

ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "TOKENIZERS_PARALLELISM": "false"}
TINY = "--config=configs/minihack_room.py:tiny"


def _train(*args, env=None, prefix=()):
    r = subprocess.run(
        [*prefix, sys.executable, "launch/train.py", *args],
        cwd=REPO,
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return r.returncode, r.stderr.splitlines(), r.stdout


CASES = [
    # (case, args, exit code, first stderr line starts with)
    ("missing config file", ["--config=configs/no_such.py:tiny"], 2, "error: config file 'configs/no_such.py' not found"),
    ("unknown key", [TINY, "--config.no_such_key=1"], 2, "error: --config.no_such_key: config key no_such_key does not exist"),
    (
        "misspelled key",
        [TINY, "--config.actor.llr=1"],
        2,
        'error: --config.actor.llr: config key actor.llr does not exist. Did you mean "lr" instead of "llr"?',
    ),
    (
        "unknown variant word",
        ["--config=configs/minihack_room.py:tinyy"],
        2,
        "error: --config=configs/minihack_room.py:tinyy: config variant word 'tinyy' unknown",
    ),
    ("out-of-range value", [TINY, "--config.actor.loss.clip_eps=3"], 2, "error: config key actor.loss.clip_eps: must be in (0, 1)"),
    # 16.3: validate() runs on the final config, after the command line's overrides
    ("odd group size", [TINY, "--config.rollout.group_size=3"], 2, "error: config key rollout.group_size: must be even"),
    (
        "decay with frozen layers",
        [TINY, "--config.actor.trainable_layers=1", "--config.actor.weight_decay=0.1"],
        2,
        "error: config key actor.weight_decay: must be 0 with actor.trainable_layers=1",
    ),
    (
        "too many trainable layers",
        [TINY, "--config.extractor.trainable_layers=3", "--config.train.steps=1"],
        2,
        "error: config key extractor.trainable_layers=3 must be in [0, 2] for extractor.model",
    ),
    ("bad value type", [TINY, "--config.actor.lr=abc"], 2, "error: flag --config.actor.lr=abc: could not convert"),
    ("unknown flag", [TINY, "--no_such_flag=1"], 2, "error: Unknown command line flag 'no_such_flag'"),
]  # fmt: skip


@pytest.mark.parametrize("case,args,code,first", CASES, ids=[c[0] for c in CASES])
def test_command_line_mistakes_are_two_lines(tmp_path, case, args, code, first):
    work = tmp_path / "run"
    rc, err, _ = _train(*args, f"--workdir={work}")
    assert rc == code, err
    assert err[0].startswith(first), err
    assert len(err) == 2 and not any("Traceback" in line for line in err), err
    assert not work.exists()  # no half-made run directory (it used to hold a 0-byte config.json)


def test_misspelled_config_file_suggests_the_right_one(tmp_path):
    rc, err, _ = _train("--config=configs/minihack_rom.py:tiny", f"--workdir={tmp_path / 'r'}")
    assert rc == 2
    assert err[1].startswith('Did you mean "configs/minihack_room.py"?'), err


def test_verbosity_adds_the_traceback(tmp_path):
    rc, err, _ = _train(
        TINY, "--config.actor.loss.clip_eps=3", f"--workdir={tmp_path / 'r'}", "--verbosity=1"
    )
    assert rc == 2
    assert err[0] == "Traceback (most recent call last):"
    assert err[-2] == "error: config key actor.loss.clip_eps: must be in (0, 1), got 3.0"


def test_workdir_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    rc, err, _ = _train(TINY, f"--workdir={f}")
    assert rc == 2 and err[0] == f"error: --workdir={f} is a file, not a directory", err
    rc, err, _ = _train(TINY, f"--workdir={f}/sub")
    assert rc == 2 and err[0].startswith(f"error: --workdir={f}/sub: a part of the path is a file"), err
    assert f.read_text() == "x"


def test_missing_data(tmp_path):
    """WebShop with an empty data root fails at start-up naming the missing path; the run directory it had
    created is removed, and a pre-existing empty one is left empty."""
    empty = tmp_path / "data"
    empty.mkdir()
    work = tmp_path / "run"
    args = ["--config=configs/webshop.py:tiny", "--config.env.workers=1"]
    rc, err, _ = _train(*args, f"--workdir={work}", env={"COMPRL_DATA": str(empty)})
    assert rc == 1, err
    assert err[0] == (
        f"error: environment data file '{empty}/webshop' is missing; see {empty}/README.md for what belongs "
        "there, or set $COMPRL_DATA / data_dir="
    ), err
    assert len(err) == 2 and not work.exists()
    work.mkdir()
    rc, err, _ = _train(*args, f"--workdir={work}", env={"COMPRL_DATA": str(empty)})
    assert rc == 1 and work.is_dir() and os.listdir(work) == []


def _mount_ns():
    """Runs the command in a private mount namespace (as root, or as a user through a user namespace)."""
    for prefix in (["unshare", "-m"], ["unshare", "-rm"]):
        try:
            ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return prefix
    pytest.skip("no mount namespace here (unshare -m / -rm); the tmpfs cases need one")


def _on_tmpfs(tmp_path, opts, *args, fill=False):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = f"mount -t tmpfs -o {opts} tmpfs {mnt} || exit 99; "
    if fill:
        script += f"dd if=/dev/zero of={mnt}/fill bs=4k 2>/dev/null; "
    script += 'exec "$@"'
    cmd = [sys.executable, "launch/train.py", *args, f"--workdir={mnt}/run"]
    r = subprocess.run(
        [*_mount_ns(), "sh", "-c", script, "sh", *cmd],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode == 99:
        pytest.skip(f"tmpfs mount refused: {r.stderr.strip()}")
    return r.returncode, r.stderr.splitlines()


def test_workdir_not_writable(tmp_path):
    rc, err = _on_tmpfs(tmp_path, "ro,size=64k", TINY)
    assert rc == 2, err
    assert err[0] == f"error: --workdir={tmp_path}/mnt/run is not writable (Read-only file system)", err
    assert len(err) == 2


def test_full_disk_before_start(tmp_path):
    rc, err = _on_tmpfs(tmp_path, "size=64k", TINY, fill=True)
    assert rc == 1, err
    assert (
        err[0]
        == f"error: --workdir={tmp_path}/mnt/run: no space left on its device (No space left on device)"
    )
    assert len(err) == 2


def test_full_disk_while_starting(tmp_path):
    """Room for config.json but not for the tiny tokenizer: the disk fills during start-up (an OSError deep in
    the tokenizer trainer); two lines, and the half-made run directory is gone."""
    rc, err = _on_tmpfs(tmp_path, "size=8k", TINY, "--config.env.workers=1")
    assert rc == 1, err
    assert err[0] == f"error: no space left on the device holding {tmp_path}/mnt/run", err
    assert err[1].startswith("free some space and run the same command again")
    assert len(err) == 2
    assert not (tmp_path / "mnt" / "run").exists()


# -- --print_config (16.5) -----------------------------------------------------------------------------
def test_print_config_final_values_with_comments():
    rc, err, out = _train(TINY, "--config.actor.lr=0.002", "--config.rollout.group_size=6", "--print_config")
    assert rc == 0, err
    lines = out.splitlines()
    assert "actor.lr = 0.002" in lines  # the override, not the :tiny value (no comment on that key)
    assert any(
        line.startswith("rollout.group_size = 6 ") and line.endswith("# K: K/2 guided + K/2 free")
        for line in lines
    )
    assert any(line.startswith("actor.model = 'tiny' ") for line in lines)
    keys = [line.split(" = ")[0] for line in lines]
    assert len(keys) == len(set(keys)) > 80 and keys[:3] == ["experiment", "seed", "method"]


def test_readme_print_config_command_runs():
    """README's --print_config line works as written (16.5: README points to it)."""
    with open(os.path.join(REPO, "README.md")) as f:
        line = next(
            ln for ln in f if ln.startswith(".venv/bin/python launch/train.py") and "--print_config" in ln
        )
    rc, err, out = _train(*line.split()[2:])
    assert rc == 0, err
    assert "actor.lr = 0.0003" in out.splitlines()


def test_config_comments_parsed_from_source(tmp_path):
    src = tmp_path / "cfg.py"
    src.write_text(
        "def base_config():\n"
        "    c = ml_collections.ConfigDict()\n"
        "    c.a = 1  # inline\n"
        "    # A block\n"
        "    # of two lines\n"
        "    c.b = (\n"
        "        2  # wrapped by the formatter\n"
        "    )\n"
        "    # continues the comment above\n"
        "    c.d = 3\n"
        "    c.e = 4\n"
        "    return c\n"
    )
    assert lu.config_comments(str(src)) == {
        "a": "inline",
        "b": "wrapped by the formatter continues the comment above",
    }  # c.d: its block (lower case, after a commented line) went to c.b; c.e: none
    # and the real file: every key of the base config that has a comment keeps it
    real = lu.config_comments()
    assert real["rollout.group_size"] == "K: K/2 guided + K/2 free"
    assert real["retrieval.clock"].startswith("Recency clock of Eq. 6.")


def test_config_diff_and_free_keys():
    old = {"seed": 0, "actor": {"lr": 1e-3, "model": "tiny"}, "env": {"tasks": ["a"]}, "train": {"steps": 2}}
    new = {"seed": 1, "actor": {"lr": 1e-3, "model": "x"}, "env": {"tasks": ("a",)}, "train": {"steps": 5}}
    assert lu.config_diff(old, new, ignore=lu.RESUME_FREE_KEYS) == [
        ("seed", 0, 1),
        ("actor.model", "tiny", "x"),
    ]
    assert lu.config_diff(old, {**old, "extra": {"k": 1}}) == [("extra.k", None, 1)]


def test_argv_verbosity():
    assert lu.argv_verbosity(["x", "--verbosity=1"]) == 1
    assert lu.argv_verbosity(["x", "-v", "0"]) == 0
    assert lu.argv_verbosity(["x", "--workdir=v"]) is None


def test_resume_with_changed_config_is_refused(tmp_path):
    """16.4, without training: a run directory with a checkpoint step and another config.json."""
    work = tmp_path / "run"
    (work / "checkpoints" / "2").mkdir(parents=True)
    cfg = _tiny_config_json()
    (work / "config.json").write_text(json.dumps(cfg))
    rc, err, _ = _train(
        TINY, "--config.seed=5", "--config.actor.lr=0.01", "--config.train.steps=40", f"--workdir={work}"
    )
    assert rc == 2, err
    assert err[0] == (
        f"error: --workdir={work} holds a run at step 2 with another config: seed 0 -> 5, actor.lr 0.001 -> 0.01"
    ), err
    assert err[1].startswith("run with that run's flags, pass --allow_config_change")
    assert json.loads((work / "config.json").read_text()) == cfg  # untouched


def _tiny_config_json():
    from comprl_jax import config as config_lib

    return lu.config_tree(config_lib.load_file(os.path.join(REPO, "configs", "minihack_room.py") + ":tiny"))


def test_describe_maps_exceptions_to_two_lines():
    # Orbax (tensorstore) reports a full disk as a ValueError carrying the OS error code, chained under others
    ts = ValueError("RESOURCE_EXHAUSTED: Error writing ... Failed to write 208498 bytes [os_error_code='28']")
    try:
        try:
            raise ts
        except ValueError as e:
            raise RuntimeError("save failed") from e
    except RuntimeError as wrapped:
        err = lu.describe(wrapped, workdir="/runs/x")
    assert (err.what, err.code) == ("no space left on the device holding /runs/x", lu.RUN_EXIT)
    err = lu.describe(PermissionError(13, "Permission denied", "/data/x"))
    assert err.what == "cannot access /data/x: Permission denied"
    err = lu.describe(ValueError("config key actor.micro_batch: must be a multiple of 4"))
    assert (err.todo, err.code) == (
        "set it with --config.actor.micro_batch=...; --print_config lists every key",
        2,
    )
    assert lu.describe(ZeroDivisionError("division by zero")) is None  # a bug: reported with its traceback
