"""MetricsWriter resume semantics, percentiles, curves.png (method comparison, seed bands), TensorBoard."""

import os

import numpy as np
import pytest

from comprl_jax.runtime.metrics import (
    MetricsWriter,
    curves_figure,
    percentiles,
    plot_curves,
    read_jsonl,
    seed_curve,
    smooth,
)


def test_writer_resume_drops_lines_after_checkpoint(tmp_path):
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    for s in range(5):
        w.write(s, {"success": s / 10, "bad": float("nan"), "text": "x"}, wall_time=1.0)
    w.close()
    rows = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert "bad" not in rows[0] and "text" not in rows[0]
    w2 = MetricsWriter(str(tmp_path), resume_step=3, tensorboard=True)
    w2.write(3, {"success": 0.9}, wall_time=2.0)
    w2.close()
    rows = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[-1]["success"] == 0.9
    assert os.path.isdir(os.path.join(tmp_path, "tb"))


def test_torn_last_line_is_ignored(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0, "a": 1}\n{"step": 1, "a"')
    assert read_jsonl(str(p)) == [{"step": 0, "a": 1}]


def test_percentiles_hand_computed():
    # numpy linear interpolation: p50 of 1..5 = 3; p90 = 4.6
    assert percentiles([1, 2, 3, 4, 5], qs=(50, 90)) == {"p50": 3.0, "p90": 4.6}
    assert percentiles([]) == {}


def test_plot_curves_writes_png(tmp_path):
    for name in ("a", "b"):
        w = MetricsWriter(str(tmp_path / name), tensorboard=False)
        for s in range(10):
            w.write(s, {"success": s / 10, "actions_per_episode": 10 - s})
    out = plot_curves(
        {"baseline": str(tmp_path / "a/metrics.jsonl"), "crl": str(tmp_path / "b/metrics.jsonl")},
        str(tmp_path / "plot.png"),
    )
    assert os.path.getsize(out) > 1000


# -- curves.png (issue 16.7) ---------------------------------------------------------------------------
def test_smooth_is_a_trailing_mean_from_the_first_point():
    # window 3 over 1..5: [1, (1+2)/2, (1+2+3)/3, (2+3+4)/3, (3+4+5)/3]
    np.testing.assert_allclose(smooth([1, 2, 3, 4, 5], 3), [1.0, 1.5, 2.0, 3.0, 4.0])
    np.testing.assert_allclose(smooth([4, 2], 1), [4.0, 2.0])
    assert smooth([], 5).size == 0


def test_seed_curve_mean_and_standard_error():
    a = (np.array([0, 1, 2]), np.array([0.0, 1.0, 0.0]))
    b = (np.array([0, 1, 2]), np.array([1.0, 1.0, 1.0]))
    cur = seed_curve([a, b], window=2)
    # smoothed a = [0, 0.5, 0.5], b = [1, 1, 1]; se of two values = |x - y| / 2
    np.testing.assert_allclose(cur["mean"], [0.5, 0.75, 0.75])
    np.testing.assert_allclose(cur["stderr"], [0.5, 0.25, 0.25])
    np.testing.assert_allclose(cur["raw"], [0.5, 1.0, 0.5])
    # seeds that logged different steps: the union, each step averaged over the seeds that have it
    cur = seed_curve([(np.array([0, 1]), np.array([2.0, 4.0])), (np.array([1, 2]), np.array([0.0, 6.0]))], 1)
    np.testing.assert_array_equal(cur["steps"], [0, 1, 2])
    np.testing.assert_array_equal(cur["n"], [1, 2, 1])
    np.testing.assert_allclose(cur["mean"], [2.0, 2.0, 6.0])
    assert np.isnan(cur["stderr"][0]) and np.isnan(cur["stderr"][2]) and cur["stderr"][1] == 2.0
    assert seed_curve([(np.array([]), np.array([]))], 3) is None


def _fake_run(path, seed, guided=True, steps=8):
    w = MetricsWriter(str(path), tensorboard=False)
    for s in range(steps):
        row = {"success": (s + seed) % 3 / 2, "actions_per_episode": 10 - s, "invalid_per_episode": 1.0}
        if guided:
            row.update({"success/guided": 0.5, "success/free": 0.25, "bank/size": s})
            if s % 3 == 2:
                row["extractor/reward_mean"] = 0.1 * s
        else:
            row["success/free"] = 0.25
        w.write(s, row)
    return str(path / "metrics.jsonl")


def test_curves_figure_compares_methods_with_seed_bands(tmp_path):
    base = _fake_run(tmp_path / "b", 0, guided=False)
    crl = [_fake_run(tmp_path / f"c{i}", i) for i in range(3)]
    fig = curves_figure({"baseline": base, "complementary": crl}, smooth_window=4)
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert list(axes) == [
        "success",
        "success: guided (solid) vs free (dashed) half",
        "actions per episode",
        "experience bank size",
        "extractor reward (steps with an update)",
        "invalid actions per episode",
    ]
    for ax in axes.values():
        assert "mean of the last 4 logged points; faint: raw" in ax.get_xlabel()
    legend = [t.get_text() for t in axes["success"].get_legend().get_texts()]
    assert legend == ["baseline", "complementary (3 seeds, mean ± s.e.)"]
    assert len(axes["success"].collections) == 1  # one band: the 3-seed method (one seed has no band)
    faint = [ln for ln in axes["success"].lines if ln.get_alpha() == 0.25]
    smoothed = [ln for ln in axes["success"].lines if ln.get_alpha() is None]
    assert len(faint) == 2 and max(ln.get_zorder() for ln in faint) < min(ln.get_zorder() for ln in smoothed)
    gf = [
        t.get_text() for t in axes["success: guided (solid) vs free (dashed) half"].get_legend().get_texts()
    ]
    assert gf == [
        "baseline free",
        "complementary (3 seeds, mean ± s.e.) guided",
        "complementary (3 seeds, mean ± s.e.) free",
    ]
    # the extractor reward is logged on some steps only: its points are those steps
    xr = [ln for ln in axes["extractor reward (steps with an update)"].lines if ln.get_alpha() != 0.25]
    np.testing.assert_array_equal(xr[0].get_xdata(), [2, 5])
    import matplotlib.pyplot as plt

    plt.close(fig)


# -- TensorBoard (issue 16.9) --------------------------------------------------------------------------
def test_tensorboard_reads_our_logs_with_the_printed_command(tmp_path):
    """The command the demo prints works on the logs MetricsWriter writes (`tensorboard --inspect` reads them)."""
    import shlex
    import subprocess

    from launch.common import tensorboard_command

    w = MetricsWriter(str(tmp_path))
    for s in range(3):
        w.write(s, {"success": s / 4})
    w.close()
    cmd = tensorboard_command(str(tmp_path / "tb"))
    if " -m pip install tensorboard && " in cmd:
        pytest.skip(f"tensorboard is not installed here; the command says how: {cmd}")
    argv = shlex.split(cmd)
    assert argv[1:] == ["--logdir", str(tmp_path / "tb")]
    out = subprocess.run([argv[0], "--inspect", *argv[1:]], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    assert "scalars" in text and "num_steps            3" in text, text
