"""Resume never gets stuck (issue 16.1): a step whose experience store is unreadable (truncated entries.json, missing
track.json, missing store directory) is skipped like a corrupted checkpoint, with one log line naming the file, and
the run resumes from the newest step whose checkpoint and store are both readable. Stale ``experience/<n>.tmp-*``
folders left by a kill are removed at start-up."""

import json
import logging
import os
import shutil

import pytest
from trainer_helpers import load_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")  # once per xdist worker even when other modules run between its tests
def finished(tmp_path_factory):
    from comprl_jax.loop import run as run_lib

    work = tmp_path_factory.mktemp("resume") / "run"
    run_lib.run(load_config("minihack_room", "tiny"), str(work), progress=False)  # checkpoints 1 and 2
    assert {"1", "2"} <= set(os.listdir(work / "checkpoints"))
    return work


def _damage(run, how):
    store = run / "experience" / "2"
    if how == "truncated entries.json":
        text = (store / "entries.json").read_text()
        (store / "entries.json").write_text(text[: len(text) // 2])
        return "entries.json"
    if how == "missing track.json":
        (store / "track.json").unlink()
        return "track.json"
    shutil.rmtree(store)
    return os.path.join("experience", "2")


@pytest.mark.parametrize("how", ["truncated entries.json", "missing track.json", "missing store"])
def test_bad_experience_store_falls_back_to_the_previous_step(finished, tmp_path, how, caplog):
    from comprl_jax.loop.trainer import Trainer

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    named = _damage(run, how)
    (run / "experience" / "2.tmp-deadbeef").mkdir()  # a kill during a store save leaves this behind
    tr = Trainer(load_config("minihack_room", "tiny"), str(run))
    try:
        with caplog.at_level(logging.WARNING, logger="comprl_jax.runtime.checkpoint"):
            assert tr.restore()
        assert tr.step == 1  # step 2's checkpoint is fine, its store is not
        lines = [r.getMessage() for r in caplog.records if "step 2" in r.getMessage()]
        assert len(lines) == 1 and named in lines[0], lines
        assert not (run / "experience" / "2.tmp-deadbeef").exists()
        with open(run / "experience" / "1" / "entries.json") as f:  # the bank is step 1's
            assert [e["uid"] for e in json.load(f)] == list(tr.track.mgr.bank.entries)
    finally:
        tr.close()
