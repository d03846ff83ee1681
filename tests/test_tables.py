"""make_tables (issue 16.8): runs grouped by (experiment, method), seeds averaged with their spread and count,
single-task runs in their own table, every run's placement printed; the eval table of train.py/demo.py (16.10)."""

import json
import subprocess
import sys

import pytest
from trainer_helpers import REPO

from launch.tables import (
    TABLE1_ENVS,
    eval_table,
    load_run,
    mean_se,
    normalize_eval,
    placements,
    report,
    single_task_table,
    table1,
)

ROOM, WEBSHOP, ALFWORLD = TABLE1_ENVS


def _entry(env, success, episodes=8, infra=0, split="eval", score=None):
    return {
        "env_id": env,
        "split": split,
        "tasks": episodes // 2,
        "success": success,
        "episodes": episodes,
        "infra_failed": infra,
        "mean_reward": 0.0,
        "score": round(success + 0.25, 6) if score is None else score,  # graded reward: above success
        "actions": 12.5,
    }


def _run(tmp_path, name, method, ev, experiment="multitask3", tasks=TABLE1_ENVS, seed=0, model="tiny"):
    d = tmp_path / name
    d.mkdir()
    cfg = {"method": method, "experiment": experiment, "seed": seed, "env": {"tasks": list(tasks)}}
    cfg["actor"] = {"model": model}
    (d / "config.json").write_text(json.dumps(cfg))
    if ev is not None:
        (d / "eval.json").write_text(json.dumps(ev))
    return str(d)


def _ev(mode_values: dict) -> dict:
    """{mode: [success per Table-1 env]} -> eval.json in the current format."""
    return {
        m: {e: _entry(e, v) for e, v in zip(TABLE1_ENVS, vals, strict=True)}
        for m, vals in mode_values.items()
    }


def test_mean_se_hand_computed():
    # 0.5, 0.6, 0.7: mean 0.6, sample sd 0.1, se 0.1 / sqrt(3) = 0.0577
    mean, se, n = mean_se([0.5, 0.6, 0.7])
    assert (round(mean, 12), round(se, 4), n) == (0.6, 0.0577, 3)
    assert mean_se([0.25]) == (0.25, None, 1)
    assert mean_se([None]) is None


def test_table1_averages_seeds_and_keeps_the_old_format(tmp_path):
    runs = [
        load_run(_run(tmp_path, f"crl{s}", "complementary", _ev({"with_exp": v, "without_exp": v}), seed=s))
        for s, v in enumerate([[0.5, 0.6, 0.7], [0.6, 0.6, 0.7], [0.7, 0.6, 0.7]])
    ]
    # an older run: {mode: {env_id: score}}
    old = _run(
        tmp_path, "base", "baseline", {"without_exp": dict(zip(TABLE1_ENVS, [0.4, 0.5, 0.6], strict=True))}
    )
    runs.append(load_run(old))
    text = table1(runs)
    # Room: success 0.5/0.6/0.7 -> 0.60 ± 0.06 (3); WebShop: its score (success 0.6 + 0.25) x3 -> 0.85, se 0;
    # ALFWorld: success 0.7; per-seed averages 0.6833, 0.7167, 0.75 -> mean 0.7167, sd 0.0333, se 0.0192
    assert (
        "| Complementary RL (eval with exp.) | 0.60 ± 0.06 (3) / 0.78 | 0.85 ± 0.00 (3) / 0.87 | "
        "0.70 ± 0.00 (3) / 0.82 | 0.72 ± 0.02 (3) / 0.82 |" in text
    )
    # the old format recorded success only: no WebShop score, so no average
    assert "| Baseline | 0.40 (1) / 0.68 | - / 0.81 | 0.60 (1) / 0.72 | - / 0.75 |" in text
    assert "| Exp. Only | - / 0.49 | - / 0.37 | - / 0.13 | - / 0.33 |" in text
    assert runs[-1]["old_format"] and not runs[0]["old_format"]


def test_single_task_runs_get_their_own_table_and_every_run_is_placed(tmp_path):
    room = (ROOM,)
    mt = [load_run(_run(tmp_path, "mt", "complementary", _ev({"with_exp": [0.5, 0.5, 0.5]})))]
    single = [
        load_run(
            _run(
                tmp_path,
                f"room_crl{s}",
                "complementary",
                {"with_exp": {ROOM: _entry(ROOM, v, infra=1)}, "without_exp": {ROOM: _entry(ROOM, v - 0.1)}},
                experiment="minihack_room",
                tasks=room,
                seed=s,
            )
        )
        for s, v in enumerate([0.6, 0.8])
    ]
    base = load_run(
        _run(
            tmp_path,
            "room_base",
            "baseline",
            {"without_exp": {ROOM: _entry(ROOM, 0.5)}},
            experiment="minihack_room",
            tasks=room,
        )
    )
    pending = load_run(
        _run(tmp_path, "room_new", "complementary", None, experiment="minihack_room", tasks=room, seed=2)
    )
    runs = mt + single + [base, pending]
    t1 = table1(runs)
    assert "| Complementary RL (eval with exp.) | 0.50 (1) / 0.78 |" in t1  # the single-task runs stay out
    st = single_task_table(runs)
    # with exp.: 0.6, 0.8 (and a run without eval.json) -> 0.70 ± 0.10 (2); 16 episodes, 2 infra failures;
    # 0.70 / 0.50 (baseline) = 1.40x, the paper's ≈1.3x beside it
    assert (
        "| minihack_room | MiniHack-Room-Ultimate-5x5-v0 | complementary | with exp. | 0.70 ± 0.10 (2) | 16 | 2 "
        "| 1.40 / ≈1.3 |" in st
    )
    assert (
        "| minihack_room | MiniHack-Room-Ultimate-5x5-v0 | baseline | without exp. | 0.50 (1) | 8 | 0 | - / - |"
        in st
    )
    where = placements(runs).splitlines()
    assert where[0].startswith(
        f"- {tmp_path / 'mt'} -> Table 1: multitask3 / complementary (3 tasks, tiny), seed 0"
    )
    assert where[1].startswith(
        f"- {tmp_path / 'room_crl0'} -> single-task table: minihack_room / complementary (1 task, tiny), seed 0, "
        "3 runs in the group; 16 eval episodes, 1 infra failures"
    )
    assert any(
        w.startswith(f"- {tmp_path / 'room_new'} -> single-task table") and "no eval.json yet" in w
        for w in where
    )
    assert len(where) == len(runs)
    text = report(runs)
    assert text.index("## Table 1") < text.index("## Single-task runs") < text.index("## Runs (where")


def test_models_are_not_averaged_together(tmp_path):
    a = load_run(_run(tmp_path, "a", "complementary", _ev({"with_exp": [1, 1, 1]}), model="tiny"))
    b = load_run(
        _run(tmp_path, "b", "complementary", _ev({"with_exp": [0, 0, 0]}), model="smollm2_135m_instruct")
    )
    text = table1([a, b])
    assert "| Complementary RL (eval with exp.) [tiny] | 1.00 (1) / 0.78 |" in text
    assert "| Complementary RL (eval with exp.) [smollm2_135m_instruct] | 0.00 (1) / 0.78 |" in text


def test_normalize_eval_reads_both_formats():
    new = {"without_exp": {f"{ALFWORLD}@valid_seen": _entry(ALFWORLD, 0.25, split="valid_seen")}}
    assert normalize_eval(new)["without_exp"][f"{ALFWORLD}@valid_seen"]["split"] == "valid_seen"
    old = normalize_eval({"with_exp": {ROOM: 0.5}})
    assert old["with_exp"][ROOM] == {
        "env_id": ROOM,
        "split": None,
        "success": 0.5,
        "episodes": None,
        "infra_failed": None,
        "mean_reward": None,
        "old_format": True,
    }


def test_eval_table_is_aligned():
    ev = {
        "without_exp": {
            ALFWORLD: _entry(ALFWORLD, 0.25, infra=1, split="valid_unseen"),
            f"{ALFWORLD}@valid_seen": _entry(ALFWORLD, 0.5, split="valid_seen"),
        },
        "with_exp": {ALFWORLD: _entry(ALFWORLD, 0.375, split="valid_unseen")},
    }
    lines = eval_table(ev).splitlines()
    w = "success  score  actions  tasks  episodes  infra"
    assert lines == [
        "held-out eval                 |              |" + f" {'with experience':^{len(w)}} |"
        + f" {'without experience':^{len(w)}}".rstrip(),
        f"env                           | split        | {w} | {w}",
        "comprl/ALFWorld-v0            | valid_unseen |   0.375  0.625     12.5      4         8      0"
        " |   0.250  0.500     12.5      4         8      1",
        "comprl/ALFWorld-v0@valid_seen | valid_seen   |       -      -        -      -         -      -"
        " |   0.500  0.750     12.5      4         8      0",
    ]  # fmt: skip
    # an older eval.json: no split, no counts
    assert eval_table({"without_exp": {ROOM: 0.5}}).splitlines()[-1] == (
        f"{ROOM} |   0.500      -        -      -         -      -"
    )
    assert eval_table({}) == "held-out eval: no episodes"


def test_missing_run_dir_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_run(str(tmp_path / "nope"))
    r = subprocess.run(
        [sys.executable, "launch/make_tables.py", f"--runs={tmp_path / 'nope'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert r.stderr.splitlines()[0] == (
        f"error: {tmp_path / 'nope'}/config.json not found: is '{tmp_path / 'nope'}' a run directory written by "
        "launch/train.py?"
    )


def test_cli_groups_seeds_and_plots_them_on_shared_axes(tmp_path):
    from comprl_jax.runtime.metrics import MetricsWriter

    for name, method, seed in (
        ("crl0", "complementary", 0),
        ("crl1", "complementary", 1),
        ("base", "baseline", 0),
    ):
        d = _run(tmp_path, name, method, _ev({"without_exp": [0.5, 0.5, 0.5]}), seed=seed)
        w = MetricsWriter(d, tensorboard=False)
        for s in range(6):
            w.write(s, {"success": s / 10, "actions_per_episode": 10 - s, "success/free": 0.1})
    out = subprocess.run(
        [
            sys.executable,
            "launch/make_tables.py",
            f"--runs={tmp_path}/*",
            f"--plot={tmp_path / 'fig.png'}",
            "--smooth=2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "| Complementary RL (eval without exp.) | 0.50 ± 0.00 (2) / 0.75 |" in out
    assert (
        f"- {tmp_path / 'crl1'} -> Table 1: multitask3 / complementary (3 tasks, tiny), seed 1, 2 runs in the"
        in out
    )
    assert f"plot: {tmp_path / 'fig.png'}" in out and (tmp_path / "fig.png").stat().st_size > 1000


def test_second_half_success_is_the_pre_registered_statistic():
    """Issue 19's statistic by hand: 5 logged steps -> steps 3 and 4 count (ceil(5 / 2) = 3)."""
    from launch.tables import second_half_success

    rows = [
        {"step": 0, "success": 0.5, "success/free": 0.0, "success/guided": 1.0},
        {"step": 1, "success": 0.5, "success/free": 0.25, "success/guided": 0.75},
        {"step": 2, "success": 0.5, "success/free": 0.5, "success/guided": 0.5},
        {"step": 2, "eval/x/without_exp": 0.9},  # an eval-only record does not count as a step
        {"step": 3, "success": 0.5, "success/free": 0.125, "success/guided": 0.875},
        {"step": 4, "success": 0.5, "success/free": 0.375, "success/guided": 0.625},
    ]
    assert second_half_success(rows, "free") == pytest.approx((0.125 + 0.375) / 2)
    assert second_half_success(rows, "guided") == pytest.approx((0.875 + 0.625) / 2)
    baseline = [{"step": s, "success": v} for s, v in enumerate([0.0, 0.1, 0.2, 0.3])]
    assert second_half_success(baseline, "free") == pytest.approx(0.25)  # every episode is free
    assert second_half_success(baseline, "guided") is None
    assert second_half_success(rows, "free", first_half=True) == pytest.approx((0.0 + 0.25 + 0.5) / 3)
    assert second_half_success(baseline, "free", first_half=True) == pytest.approx(0.05)
    resumed = [*baseline, {"step": 3, "success": 0.5}]  # a step logged again after a resume: the last wins
    assert second_half_success(resumed, "free") == pytest.approx(0.35)
    assert second_half_success([], "free") is None
