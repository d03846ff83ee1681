"""The SWE-Lite sandbox (issue 32 point 3): every escape a model's command might try ends with a clean observation
and leaves the host untouched (comprl_jax/envs/swe/sandbox.py's table)."""

import os
import shutil
import socket
import threading
import time

import pytest

from comprl_jax.envs.swe import sandbox as sb

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap missing: `make setup` installs it"
)

LIMITS = sb.SandboxLimits(wall_s=6.0, cpu_s=5, memory_mb=512, processes=32, file_mb=4, tmp_mb=8)


def _box(tmp_path, name="task_a", **kw):
    d = tmp_path / name
    d.mkdir()
    (d / "mod.py").write_text("X = 1\n")
    return sb.Sandbox(str(d), limits=kw.pop("limits", LIMITS), **kw), d


def _procs_of(uid: int) -> list[str]:
    """Host processes whose real uid is ``uid``: what a sandbox left behind."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
        except OSError:
            continue  # exited while we looked
        line = next(ln for ln in status.splitlines() if ln.startswith("Uid:"))
        if int(line.split()[1]) == uid:
            out.append(pid)
    return out


def _settled(uid: int, timeout: float = 5.0) -> list[str]:
    """The kernel reaps a killed namespace asynchronously: wait for it before calling a process stray."""
    deadline = time.monotonic() + timeout
    while (left := _procs_of(uid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_the_working_copy_is_the_only_writable_place(tmp_path):
    box, d = _box(tmp_path)
    r = box.run("echo changed > mod.py && mkdir -p pkg && echo 1 > pkg/new.txt && pwd")
    assert r.ok and r.output.strip() == sb.MOUNT
    assert (d / "mod.py").read_text() == "changed\n" and (d / "pkg" / "new.txt").exists()
    marker = f"comprl_sandbox_{os.getpid()}"
    r = box.run(
        f"touch /etc/{marker}; touch /usr/{marker}; touch /{marker}; echo x > /tmp/{marker} && cat /tmp/{marker}"
    )
    # /etc and /usr are read-only mounts; / is the sandbox's own root-owned tmpfs
    assert r.output.count("Read-only file system") == 2 and r.output.count("Permission denied") == 1
    assert r.output.rstrip().endswith("x")
    for p in (f"/etc/{marker}", f"/usr/{marker}", f"/{marker}", f"/tmp/{marker}"):
        assert not os.path.exists(p)  # the sandbox's /tmp is its own tmpfs


def test_another_tasks_copy_and_the_repository_are_not_there(tmp_path):
    box, _ = _box(tmp_path, "task_a")
    other = tmp_path / "task_b"
    other.mkdir()
    (other / "secret.py").write_text("ANSWER = 42\n")
    here = os.path.dirname(os.path.abspath(__file__))
    r = box.run(f"cat {other}/secret.py; ls {tmp_path}; ls {here}; ls /root /home 2>&1 | head -3")
    assert "ANSWER" not in r.output and "test_swe_sandbox" not in r.output
    assert r.output.count("No such file or directory") >= 3


def test_no_network_not_even_the_hosts_loopback(tmp_path):
    box, _ = _box(tmp_path)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(3)
    port = srv.getsockname()[1]
    got = []
    t = threading.Thread(target=lambda: got.append(_accept(srv)), daemon=True)
    t.start()
    code = (
        "import socket\n"
        "for host in ('127.0.0.1', '1.1.1.1', 'pypi.org'):\n"
        "    try:\n"
        f"        socket.create_connection((host, {port} if host == '127.0.0.1' else 443), timeout=2)\n"
        "        print('CONNECTED', host)\n"
        "    except OSError as e:\n"
        "        print('refused', host, type(e).__name__)\n"
    )
    (tmp_path / "task_a" / "net.py").write_text(code)
    r = box.run("python3 net.py")
    t.join()
    srv.close()
    assert "CONNECTED" not in r.output and r.output.count("refused") == 3, r.output
    assert got == [None]  # the host's listener saw no connection


def _accept(srv):
    try:
        conn, _ = srv.accept()
        conn.close()
        return "connection"
    except OSError:
        return None


def test_fork_bomb_ends_cleanly_and_leaves_no_process(tmp_path):
    box, _ = _box(tmp_path)
    t0 = time.monotonic()
    # the command waits, so the bomb runs into the process limit (returning at once would end it with the namespace)
    r = box.run(":(){ :|:& };:; sleep 2; echo waited")
    assert time.monotonic() - t0 < LIMITS.wall_s + 3
    assert r.killed in ("wall", None) and "Resource temporarily unavailable" in r.output
    assert _settled(box.uid) == []
    assert box.run("echo alive").output == "alive\n"  # the host and the box still work


def test_unbounded_allocation_fails_inside(tmp_path):
    box, _ = _box(tmp_path)
    r = box.run("python3 -c 'x = bytearray(8 << 30)'")
    assert r.exit_code == 1 and "MemoryError" in r.output and r.killed is None


def test_an_endless_loop_is_killed_at_the_wall_limit(tmp_path):
    box, _ = _box(tmp_path)
    lim = sb.SandboxLimits(wall_s=1.5, cpu_s=30)
    r = box.run("sleep 1000 & while true; do :; done", limits=lim)
    assert r.killed == "wall" and r.exit_code is None and 1.5 <= r.wall_s < 4
    assert r.observation().endswith("[command killed: wall-clock limit reached]")
    assert _settled(box.uid) == []
    # a CPU-bound loop under a short CPU limit is SIGKILLed at it, long before the wall
    r = box.run("python3 -c 'while True: pass'", limits=sb.SandboxLimits(wall_s=20, cpu_s=1))
    assert r.killed is None and r.exit_code == 128 + 9 and r.wall_s < 10
    assert r.observation().endswith("[exit code 137: killed at the CPU-time limit]")


def test_printing_gigabytes_is_cut_and_killed(tmp_path):
    box, _ = _box(tmp_path)
    lim = sb.SandboxLimits(wall_s=20, output_bytes=1000, drain_bytes=1 << 20)
    r = box.run("yes 0123456789", limits=lim)
    assert r.killed == "output" and r.truncated and r.wall_s < 5
    head, marker = r.output[:1000], r.output[1000:]
    assert head == ("0123456789\n" * 100)[:1000]
    assert marker.startswith("\n[... output truncated:") and len(r.output) < 1100
    assert _settled(box.uid) == []
    # under the drain limit the command finishes; the count of what was dropped is exact
    r = box.run("head -c 5000 /dev/zero | tr '\\0' a; echo; exit 3", limits=lim)
    assert r.exit_code == 3 and r.killed is None and r.truncated
    assert r.output == "a" * 1000 + sb.TRUNCATION_MARKER.format(dropped=4001)


def test_a_huge_file_stops_at_the_file_size_limit(tmp_path):
    box, d = _box(tmp_path)
    r = box.run("head -c 100000000 /dev/zero > big.bin; echo rc=$?; ls -l big.bin")
    assert "rc=153" in r.output or "File size limit exceeded" in r.output  # SIGXFSZ
    assert (d / "big.bin").stat().st_size <= LIMITS.file_mb << 20


def test_background_processes_die_with_the_command(tmp_path):
    box, _ = _box(tmp_path)
    t0 = time.monotonic()
    r = box.run("sleep 1000 & disown; setsid sleep 1000 & echo started")
    assert r.ok and r.output == "started\n" and time.monotonic() - t0 < 3
    assert _settled(box.uid) == []


def test_a_hundred_episodes_leave_no_stray_process_or_file(tmp_path):
    marker = f"/tmp/comprl_sandbox_{os.getpid()}"
    uids = set()
    for i in range(100):
        box, d = _box(tmp_path, f"task_{i}")
        uids.add(box.uid)
        cmds = (
            "sleep 1000 &",  # left running: the namespace's end kills it
            f"echo $$ > {marker}_{i}; cat {marker}_{i}",  # the sandbox's own /tmp
            "python3 -c 'print(1)' > out.txt",
            "yes | head -c 10",
        )
        r = box.run(cmds[i % 4] + "\necho done")
        assert r.ok and r.output.endswith("done\n"), r.output
        shutil.rmtree(d)  # the host removes the copy the sandbox's uid owns
    assert all(_settled(u) == [] for u in uids)
    assert not [p for p in os.listdir("/tmp") if p.startswith(os.path.basename(marker))]
    assert not os.listdir(tmp_path)


def test_missing_bubblewrap_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    with pytest.raises(sb.SandboxUnavailable, match="Debian package 'bubblewrap'"):
        sb.check_available()


def test_bad_configuration_is_named(tmp_path):
    with pytest.raises(ValueError, match="SandboxLimits.wall_s must be > 0"):
        sb.SandboxLimits(wall_s=0)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        sb.Sandbox(str(tmp_path / "nope"))
    (tmp_path / "w").mkdir()
    with pytest.raises(ValueError, match="contains the working copy"):
        sb.Sandbox(str(tmp_path / "w"), ro_paths=(str(tmp_path),))
