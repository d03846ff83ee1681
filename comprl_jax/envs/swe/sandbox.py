"""A bubblewrap sandbox for commands an untrusted model writes (SWE-Lite, issue 32).

One :meth:`Sandbox.run` is one ``bash -c COMMAND`` in a fresh set of namespaces::

    bwrap --unshare-{ipc,pid,net,uts,cgroup} --die-with-parent --new-session --clearenv
          --ro-bind /usr /usr (and /etc, the merged-/usr links, each read-only path given)
          --bind WORKDIR /repo --tmpfs /tmp (size-capped) --dev /dev --proc /proc --chdir /repo --
      setpriv --reuid=U --regid=U --clear-groups --no-new-privs --bounding-set=-all   # only when we are root
        prlimit --as --cpu --nproc --fsize --nofile --core=0 --
          bash -c COMMAND

What that gives, and the limit that enforces each (tests/test_swe_sandbox.py tries every one):

| threat | what stops it |
|---|---|
| network | ``--unshare-net`` (a new network namespace holds only a down loopback) |
| writing outside the working copy | only WORKDIR is bound writable; ``/tmp`` is a private size-capped tmpfs |
| reading another task's copy, the task file, the repo | nothing but /usr, /etc and the given read-only paths is mounted |
| fork bomb | RLIMIT_NPROC for the sandbox's own uid (root is exempt from it, hence ``setpriv``), PID namespace |
| setuid binaries, capabilities | ``setpriv --no-new-privs``, empty bounding set (as root); ``--cap-drop ALL`` otherwise |
| allocating without bound | RLIMIT_AS |
| looping forever | RLIMIT_CPU per process (SIGKILL at the limit), the wall timeout for the whole tree |
| printing gigabytes | ``output_bytes`` kept, the rest counted; past ``drain_bytes`` the tree is killed; RLIMIT_FSIZE |
| processes left behind | SIGKILL to bwrap's process group; bwrap's child is PID 1 of the namespace and dies with it |
|   | (``--die-with-parent``), which takes every process of the namespace with it |

The uid is drawn per sandbox from [UID_BASE, UID_BASE + UID_SPAN) (the working copy is chowned to it), so two
sandboxes running at once do not share a process budget. Not root: the command runs as our own uid (bwrap makes an
unprivileged user namespace), and RLIMIT_NPROC then counts all our processes.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import shutil
import signal
import subprocess
import threading
import time
import zlib

MOUNT = "/repo"  # where the working copy appears inside the sandbox
UID_BASE, UID_SPAN = 200_000, 60_000
TRUNCATION_MARKER = "\n[... output truncated: {dropped} more bytes not shown ...]\n"
_SYSTEM_RO = ("/usr", "/etc")
_PATH = "/usr/local/bin:/usr/bin:/bin"


class SandboxUnavailable(RuntimeError):
    """bubblewrap (or util-linux's setpriv / prlimit) is missing or cannot create namespaces here."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 20.0  # the whole command, every process in it
    cpu_s: int = 20  # RLIMIT_CPU, per process (SIGKILL at the limit: exit code 137)
    memory_mb: int = 1024  # RLIMIT_AS, per process
    processes: int = 64  # RLIMIT_NPROC, for the sandbox's uid
    file_mb: int = 64  # RLIMIT_FSIZE: the largest file a command may write
    tmp_mb: int = 64  # the private /tmp
    open_files: int = 256  # RLIMIT_NOFILE
    output_bytes: int = 8192  # what comes back; the rest is counted and cut with TRUNCATION_MARKER
    drain_bytes: int = 16 << 20  # past this much output the tree is killed ("print gigabytes")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not v > 0:
                raise ValueError(f"SandboxLimits.{f.name} must be > 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Result:
    output: str  # stdout and stderr interleaved as written, cut at output_bytes (with the marker)
    exit_code: int | None  # None when the sandbox killed it
    killed: str | None  # None, "wall" (timeout) or "output" (past drain_bytes)
    truncated: bool
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed is None

    def observation(self) -> str:
        """The text a model sees: the output, then why it stopped where that is not a plain exit."""
        tail = ""
        if self.killed == "wall":
            tail = "\n[command killed: wall-clock limit reached]"
        elif self.killed == "output":
            tail = "\n[command killed: output limit reached]"
        elif self.exit_code == 128 + 9:
            tail = "\n[exit code 137: killed at the CPU-time limit]"
        elif self.exit_code not in (0, None):
            tail = f"\n[exit code {self.exit_code}]"
        return self.output + tail


_PROBED = False  # bwrap made its namespaces once in this process: no need to try again per sandbox


def check_available() -> None:
    """Raises :class:`SandboxUnavailable` naming what to install or enable."""
    global _PROBED
    for tool, pkg in (("bwrap", "bubblewrap"), ("prlimit", "util-linux"), ("setpriv", "util-linux")):
        if shutil.which(tool) is None:
            raise SandboxUnavailable(
                f"{tool!r} not found on PATH: the SWE sandbox needs the Debian package {pkg!r} "
                f"(apt-get install -y {pkg}; `make setup` installs it where it runs as root)"
            )
    if _PROBED:
        return
    probe = subprocess.run(
        [
            "bwrap",
            "--ro-bind",
            "/usr",
            "/usr",
            *_merged_usr_links(),
            "--unshare-all",
            "--die-with-parent",
            "/usr/bin/true",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        raise SandboxUnavailable(
            f"bwrap cannot create namespaces here ({probe.stderr.strip()[-300:]}): run as root, or enable "
            "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces)"
        )
    _PROBED = True


def _merged_usr_links() -> list[str]:
    """/bin, /lib, /lib64, /sbin as the host has them: links into /usr (Debian 12's merged /usr) or read-only binds."""
    out = []
    for p in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(p):
            out += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            out += ["--ro-bind", p, p]
    return out


class Sandbox:
    """Runs commands in ``workdir`` (mounted at ``/repo``, the only writable path) under ``limits``.

    ``ro_paths``: more host paths mounted read-only at the same place (an interpreter's environment, say); none may
    lie above ``workdir`` or hold other tasks' copies. ``env``: variables set inside (PATH, HOME=/tmp and LANG are
    set already)."""

    def __init__(
        self,
        workdir: str,
        *,
        limits: SandboxLimits = SandboxLimits(),
        ro_paths: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        uid: int | None = None,
    ):
        check_available()
        self.workdir = os.path.realpath(workdir)
        if not os.path.isdir(self.workdir):
            raise FileNotFoundError(f"sandbox working copy {workdir!r} is not a directory")
        for p in ro_paths:
            rp = os.path.realpath(p)
            if not os.path.exists(rp):
                raise FileNotFoundError(f"read-only sandbox path {p!r} does not exist")
            if self.workdir.startswith(rp.rstrip("/") + "/") or rp == "/":
                raise ValueError(
                    f"read-only path {p!r} contains the working copy {workdir!r}: mount something narrower"
                )
        self.limits = limits
        self.ro_paths = tuple(os.path.realpath(p) for p in ro_paths)
        self.env = dict(env or {})
        self.root = os.geteuid() == 0
        if self.root:
            self.uid = uid if uid is not None else UID_BASE + zlib.crc32(self.workdir.encode()) % UID_SPAN
            _chown_tree(self.workdir, self.uid)
        else:
            self.uid = os.geteuid()

    def argv(self, command: str, limits: SandboxLimits | None = None) -> list[str]:
        lim = limits or self.limits
        out = ["bwrap", "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
        if self.root:
            # every namespace but the user one: in a new user namespace only root would be mapped, and setpriv
            # could not become the sandbox's uid
            out += [
                "--unshare-ipc",
                "--unshare-pid",
                "--unshare-net",
                "--unshare-uts",
                "--unshare-cgroup-try",
            ]
        else:
            out += ["--unshare-all", "--cap-drop", "ALL"]  # an unprivileged user namespace: nothing to keep
        for p in _SYSTEM_RO:
            out += ["--ro-bind", p, p]
        out += _merged_usr_links()
        out += ["--dev", "/dev", "--proc", "/proc"]
        out += ["--size", str(lim.tmp_mb << 20), "--perms", "1777", "--tmpfs", "/tmp"]
        made = set()
        for p in self.ro_paths:  # after /tmp's tmpfs, which would hide a path under /tmp
            # bwrap makes missing parents 0700 (root's), which the sandbox's uid could not cross: make them 0755
            parts = p.strip("/").split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/" + "/".join(parts[:i])
                if d not in made and d not in (*_SYSTEM_RO, "/tmp"):
                    out += ["--perms", "0755", "--dir", d]
                    made.add(d)
            out += ["--ro-bind", p, p]
        out += ["--bind", self.workdir, MOUNT, "--chdir", MOUNT]
        env = {"PATH": _PATH, "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", **self.env}
        for k, v in env.items():
            out += ["--setenv", k, v]
        out.append("--")
        if self.root:
            # bwrap mounts as root (the working copy's parents need not be open to the sandbox's uid); inside, the
            # command drops to that uid for good: no capabilities, no setuid binaries, and RLIMIT_NPROC that binds
            out += [
                "/usr/bin/setpriv",
                f"--reuid={self.uid}",
                f"--regid={self.uid}",
                "--clear-groups",
                "--no-new-privs",
                "--bounding-set=-all",
                "--inh-caps=-all",
                "--",
            ]
        out += [
            "/usr/bin/prlimit",
            f"--as={lim.memory_mb << 20}",
            # soft = hard: SIGKILL at the limit. A soft limit's SIGXCPU can be ignored or blocked by what the
            # command inherits (under pytest-xdist it was: the loop ran on to a later hard limit)
            f"--cpu={lim.cpu_s}:{lim.cpu_s}",
            f"--nproc={lim.processes}",
            f"--fsize={lim.file_mb << 20}",
            f"--nofile={lim.open_files}",
            "--core=0",
            "--",
            "/usr/bin/bash",
            "-c",
            command,
        ]
        return out

    @property
    def repo_dir(self) -> str:
        return MOUNT

    def run(self, command: str, limits: SandboxLimits | None = None, stdin: bytes | None = None) -> Result:
        lim = limits or self.limits
        return run_capped(self.argv(command, lim), lim, stdin=stdin)


def run_capped(argv: list[str], lim: SandboxLimits, stdin: bytes | None = None) -> Result:
    """Runs ``argv`` in its own process group (one killpg ends setpriv/prlimit/bwrap, or the runtime's exec) and
    reads its merged output under ``lim``: keep ``output_bytes``, count the rest, kill the group past
    ``drain_bytes`` or ``wall_s``; reaps it and says how it ended. Both backends run through it (container.py).
    ``stdin``: bytes fed to the command (a file the editor writes), from a thread so a command that prints before
    it reads cannot deadlock against us; none: ``/dev/null``."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    if stdin is not None:
        threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
    buf = bytearray()
    dropped, killed = 0, None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        while True:
            left = lim.wall_s - (time.monotonic() - t0)
            if left <= 0:
                killed = "wall"
                break
            if not sel.select(timeout=min(left, 0.5)):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break  # EOF: every writer is gone
            room = max(lim.output_bytes - len(buf), 0)
            buf += chunk[:room]
            dropped += len(chunk) - min(len(chunk), room)
            if len(buf) + dropped > lim.drain_bytes:
                killed = "output"
                break
    finally:
        sel.close()
        if killed is not None or proc.poll() is None:
            _kill_group(proc)
        proc.stdout.close()
        code = proc.wait()
    text = buf.decode("utf-8", errors="replace")
    if dropped:
        text += TRUNCATION_MARKER.format(dropped=f"{dropped}+" if killed == "output" else dropped)
    return Result(
        output=text,
        exit_code=None if killed else code,
        killed=killed,
        truncated=bool(dropped),
        wall_s=time.monotonic() - t0,
    )


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
    except OSError:  # the command exited (or was killed) without reading it all
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _chown_tree(path: str, uid: int) -> None:
    os.chown(path, uid, uid)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.lchown(os.path.join(root, name), uid, uid)
