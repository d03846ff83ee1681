"""MetricsWriter resume semantics, percentiles and plotting."""

import os

from comprl_jax.metrics import MetricsWriter, percentiles, plot_curves, read_jsonl


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
