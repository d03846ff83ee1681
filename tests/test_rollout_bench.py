"""The rollout benchmark (issue 17.1) runs and its figures follow from the scripted workload by hand."""

import json
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[1] / "launch" / "bench" / "rollout.py"


def test_lockstep_line_counts_decode_steps_and_slot_utilisation():
    args = [
        "--slots=4",
        "--turns=3",
        "--min_reply=2",
        "--max_reply=24",
        "--prompt_tokens=16",
        "--obs_tokens=4",
    ]
    out = subprocess.run(
        [sys.executable, str(BENCH), *args, "--emit_lengths"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    lengths = line["lengths"]
    assert len(lengths) == 3 and all(len(t) == 4 and all(2 <= n <= 24 for n in t) for t in lengths)
    assert len({n for t in lengths for n in t}) > 1, "the workload must be heterogeneous"
    # Lock-step: one call per turn runs until that turn's longest reply ends.
    useful, steps = sum(map(sum, lengths)), sum(max(t) for t in lengths)
    assert (line["bench"], line["engine"], line["speedup_vs_lockstep"]) == ("rollout", "lockstep", 1.0)
    assert (line["useful_tokens"], line["decode_steps"]) == (useful, steps)
    assert line["slot_utilisation"] == round(useful / (steps * 4), 4) < 1.0
    assert line["env"] == "comprl/MiniHack-Room-5x5-v0" and line["env_s"] > 0
    assert 0 < line["device_busy_fraction"] <= 1 and line["env_hidden_s"] == 0.0
