"""The rollout benchmark (issue 17.1) runs and its figures follow from the scripted workload by hand."""

import json
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[1] / "launch" / "bench" / "rollout.py"


def test_lockstep_line_counts_decode_steps_and_slot_utilisation():
    args = [
        "--slots=4",
        "--episodes=6",
        "--turns=3",
        "--min_reply=2",
        "--max_reply=24",
        "--prompt_tokens=16",
        "--obs_tokens=4",
        "--overlap=false",
        "--peers=",
    ]
    out = subprocess.run(
        [sys.executable, str(BENCH), *args, "--emit_lengths"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    line, cont, roof = lines
    lengths = line["lengths"]
    assert len(lengths) == 3 and all(len(t) == 6 and all(2 <= n <= 24 for n in t) for t in lengths)
    assert len({n for t in lengths for n in t}) > 1, "the workload must be heterogeneous"
    # Lock-step, waves of 4 then 2 rows: one call per turn runs until that turn's longest reply in the wave ends.
    waves = [range(0, 4), range(4, 6)]
    useful = sum(map(sum, lengths))
    steps = [max(t[b] for b in w) for w in waves for t in lengths]
    slot_steps = sum(m * len(w) for w, m in zip([w for w in waves for _ in lengths], steps, strict=True))
    assert (line["bench"], line["engine"], line["speedup_vs_lockstep"]) == ("rollout", "lockstep", 1.0)
    assert (line["useful_tokens"], line["decode_steps"]) == (useful, sum(steps))
    assert line["slot_utilisation"] == round(useful / slot_steps, 4) < 1.0
    assert line["env"] == "comprl/MiniHack-Room-5x5-v0" and line["env_s"] > 0
    assert 0 < line["device_busy_fraction"] <= 1 and line["env_hidden_s"] == 0.0
    # Continuous: the same tokens; every slot-step is counted (prefill calls too), so utilisation <= 1.
    assert (cont["engine"], cont["useful_tokens"]) == ("continuous", useful)
    assert 0 < cont["slot_utilisation"] <= 1.0 and cont["speedup_vs_lockstep"] > 0
    assert roof["peer"] == "roofline" and roof["bandwidth_gb_s"] > 0 and 0 < roof["ratio"]
