"""make_tables: Table 1 layout from run directories, ours beside the paper's."""

import json
import subprocess
import sys

import pytest

from comprl_jax.tables import TABLE1_ENVS, load_run, table1


def _run(tmp_path, name, method, ev):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({"method": method, "experiment": "multitask3", "env": {"tasks": list(TABLE1_ENVS)}})
    )
    if ev is not None:
        (d / "eval.json").write_text(json.dumps(ev))
    return str(d)


def test_table1_rows_and_average(tmp_path):
    crl = _run(
        tmp_path,
        "crl",
        "complementary",
        {
            "with_exp": dict(zip(TABLE1_ENVS, [0.5, 0.6, 0.7], strict=False)),
            "without_exp": dict(zip(TABLE1_ENVS, [0.4, 0.5, 0.6], strict=False)),
        },
    )
    base = _run(tmp_path, "base", "baseline", None)
    text = table1([load_run(crl), load_run(base)])
    assert (
        "| Complementary RL (eval with exp.) | 0.50 / 0.78 | 0.60 / 0.87 | 0.70 / 0.82 | 0.60 / 0.82 |"
        in text
    )
    assert "| Baseline | - / 0.68 | - / 0.81 | - / 0.72 | - / 0.75 |" in text  # the paper prints 0.75


def test_missing_run_dir_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_run(str(tmp_path / "nope"))


def test_cli_plots_runs_together(tmp_path):
    from comprl_jax.metrics import MetricsWriter

    dirs = []
    for name, method in (("crl", "complementary"), ("base", "baseline")):
        d = _run(tmp_path, name, method, None)
        w = MetricsWriter(d, tensorboard=False)
        for s in range(6):
            w.write(s, {"success": s / 10, "actions_per_episode": 10 - s})
        dirs.append(d)
    out = subprocess.run(
        [
            sys.executable,
            "launch/make_tables.py",
            f"--runs={','.join(dirs)}",
            f"--plot={tmp_path / 'fig.png'}",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "plot:" in out and (tmp_path / "fig.png").stat().st_size > 1000


def test_cli_prints_table(tmp_path):
    crl = _run(
        tmp_path, "crl", "complementary", {"with_exp": dict(zip(TABLE1_ENVS, [1, 1, 1], strict=False))}
    )
    out = subprocess.run(
        [sys.executable, "launch/make_tables.py", f"--runs={crl}"], capture_output=True, text=True, check=True
    ).stdout
    assert "Table 1" in out and "1.00 / 0.78" in out
