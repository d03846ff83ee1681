"""A bubblewrap sandbox for commands an untrusted model writes (SWE-Lite, issue 32).

One :meth:`Sandbox.run` is one ``bash -c COMMAND`` in a fresh set of namespaces, in a fresh cgroup::

    sh -c 'join the run's memory and pids cgroups; exec "$@" 9<seccomp.bpf' --     # the launcher, on the host
      bwrap --unshare-{ipc,pid,net,uts,cgroup} --die-with-parent --new-session --clearenv --seccomp 9
            --tmpfs /usr --tmpfs /etc, filled with read-only binds of only the files a task needs (system_layout)
            and a generated passwd/group/hosts/nsswitch.conf, then --remount-ro; each given read-only path
            --bind WORKDIR /repo --tmpfs /tmp (size-capped) --dev /dev --proc /proc --chdir /repo --
        setpriv --reuid=U --regid=U --clear-groups --no-new-privs --bounding-set=-all   # only when we are root
          prlimit --as --cpu --nproc --fsize --nofile --core=0 --
            bash -c COMMAND

What that gives, and what enforces each (the test in tests/test_swe_sandbox.py that tries it, unless named):

| threat | what stops it | tried by |
|---|---|---|
| network | ``--unshare-net`` (a new network namespace holds only a down loopback) | test_no_network_not_even_the_hosts_loopback |
| writing outside the working copy | only WORKDIR is bound writable; ``/tmp`` is a private size-capped tmpfs; ``/dev/shm`` is root's | test_the_working_copy_is_the_only_writable_place |
| reading another task's copy, the task file, the repo | none of them is mounted | test_another_tasks_copy_and_the_repository_are_not_there |
| reading the answer: another copy of a task's project on the host image (a vendored copy under /usr) | no host directory is mounted whole: only the files the task needs are, one by one (:func:`system_layout`: python and its standard library, the shell tools, their libraries, a generated /etc) | tests/test_swe_visible_files.py (every task's pristine hunks against every visible file), test_the_system_is_the_tools_and_nothing_else |
| fork bomb | a pids cgroup per run (``pids.max``), RLIMIT_NPROC for the sandbox's own uid (root is exempt from it, hence ``setpriv``), PID namespace | test_fork_bomb_ends_cleanly_and_leaves_no_process |
| setuid binaries, capabilities | ``setpriv --no-new-privs``, empty bounding set (as root); ``--cap-drop ALL`` otherwise | test_user_namespaces_are_refused_inside |
| a user namespace inside (uid 0 with every capability: mounts, tmpfs past the caps) | seccomp (seccomp.py): ``unshare``/``clone`` with a ``CLONE_NEW*`` flag and ``setns`` get EPERM, ``clone3`` ENOSYS | test_user_namespaces_are_refused_inside |
| one allocation without bound | RLIMIT_AS per process (MemoryError) | test_unbounded_allocation_fails_inside |
| memory across many processes, SysV shared memory, /tmp | a memory cgroup per run (``memory.limit_in_bytes`` = ``memory_mb`` for the whole tree, tmpfs and shm pages included); at the first OOM kill in it the whole command is killed (``killed="memory"``) | test_a_memory_balloon_of_many_processes_stops_at_the_sandbox_limit, test_shared_memory_counts_against_the_limit |
| looping forever | RLIMIT_CPU per process (SIGKILL at the limit), the wall timeout for the whole tree | test_an_endless_loop_is_killed_at_the_wall_limit |
| printing gigabytes | ``output_bytes`` kept, the rest counted; past ``drain_bytes`` the tree is killed; RLIMIT_FSIZE | test_printing_gigabytes_is_cut_and_killed, test_a_huge_file_stops_at_the_file_size_limit |
| processes left behind | SIGKILL to bwrap's process group; bwrap's child is PID 1 of the namespace and dies with it (``--die-with-parent``), which takes every process of the namespace with it; what is left in the run's cgroup is killed before it is removed | test_background_processes_die_with_the_command, test_a_hundred_episodes_leave_no_stray_process_or_file |
| two live sandboxes on one uid (one's processes or files reached from the other) | a uid registry: a uid is held by an flock on ``<state>/uids/<uid>.lock`` while its Sandbox lives (released by :meth:`Sandbox.close` or garbage collection; a crashed holder's lock dies with it) | test_live_sandboxes_never_share_a_uid |
| a kernel keyring entry left for a later episode | seccomp: ``keyctl``, ``add_key``, ``request_key`` get EPERM | test_no_kernel_keyring_inside |

Not root: the command runs as our own uid in an unprivileged user namespace (RLIMIT_NPROC then counts all our
processes, and every such sandbox shares that uid; no registry). Without a usable cgroup v1 ``memory`` controller (not
root, a cgroup v2 host): the memory limit falls back to a supervisor that sums the anonymous and shared resident
memory of the command's processes every 50 ms and kills the tree past the limit (``killed="memory"``; it cannot see a
SysV segment no process maps, which the private IPC namespace still ends with the command) --
test_the_memory_fallback_kills_a_balloon. Without a ``pids`` controller the process cap is RLIMIT_NPROC alone.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import itertools
import os
import re
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import weakref
import zlib

from comprl_jax.envs.swe import seccomp

MOUNT = "/repo"  # where the working copy appears inside the sandbox
UID_BASE, UID_SPAN = 200_000, 60_000
TRUNCATION_MARKER = "\n[... output truncated: {dropped} more bytes not shown ...]\n"
_PATH = "/usr/local/bin:/usr/bin:/bin"
_SECCOMP_FD = 9  # the launcher opens the filter there for bwrap's --seccomp
_PID_OVERHEAD = 4  # over `processes`: bwrap outside, bwrap as PID 1 inside (setpriv, prlimit exec into bash)

# The shell the SWE prompt promises (coreutils, grep, sed, awk, find/xargs, diff, patch, ...), git for the bench
# backend, and what the sandbox itself execs (setpriv, prlimit). Looked up under /usr/bin:/bin:/usr/sbin:/sbin; a
# missing one is left out.
TOOLS = (
    # coreutils
    "[ arch b2sum base32 base64 basename basenc cat chgrp chmod chown cksum comm cp csplit cut date dd df dir "
    "dircolors dirname du echo env expand expr factor false fmt fold groups head hostid id install join link ln "
    "logname ls md5sum mkdir mkfifo mknod mktemp mv nice nl nohup nproc numfmt od paste pathchk pr printenv printf "
    "ptx pwd readlink realpath rm rmdir seq sha1sum sha224sum sha256sum sha384sum sha512sum shred shuf sleep sort "
    "split stat stdbuf stty sum sync tac tail tee test timeout touch tr true truncate tsort tty uname unexpand uniq "
    "unlink vdir wc whoami yes "
    # shells and text tools
    "bash sh dash grep egrep fgrep sed awk mawk gawk find xargs diff diff3 cmp sdiff patch which "
    "tar gzip gunzip zcat xxd less more "
    # util-linux the sandbox execs, and a few harmless ones; procps
    "setpriv prlimit setsid flock getopt rev ps kill pgrep pkill "
    "python3 git ldconfig"  # ldconfig -p: ctypes.util.find_library
).split()
_TREES = ("/usr/lib/git-core", "/usr/share/git-core", "/usr/share/zoneinfo", "/usr/lib/locale/C.utf8")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")  # the rest of /etc is generated (_etc_files)


class SandboxUnavailable(RuntimeError):
    """bubblewrap (or util-linux's setpriv / prlimit) is missing or cannot create namespaces here."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 20.0  # the whole command, every process in it
    cpu_s: int = 20  # RLIMIT_CPU, per process (SIGKILL at the limit: exit code 137)
    memory_mb: int = 1024  # the whole command (a memory cgroup: tmpfs, shm too); RLIMIT_AS per process too
    processes: int = 64  # the whole command (pids cgroup), and RLIMIT_NPROC for the sandbox's uid
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
    killed: str | None  # None, "wall" (timeout), "output" (past drain_bytes), "memory" (memory_mb)
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
        elif self.killed == "memory":
            tail = "\n[command killed: memory limit reached]"
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
    try:
        seccomp.program()
    except seccomp.UnsupportedArch as e:
        raise SandboxUnavailable(str(e)) from None
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


# -- state on the host: the uid registry, the seccomp program, generated /etc files ----------------------------
@functools.cache
def state_dir() -> str:
    """Where the sandbox keeps its host-side state (never mounted inside): ``/run/comprl_jax_sandbox`` as root."""
    if os.geteuid() == 0 and os.access("/run", os.W_OK):
        d = "/run/comprl_jax_sandbox"
    else:
        base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        d = os.path.join(base, f"comprl_jax_sandbox-{os.geteuid()}")
    os.makedirs(d, mode=0o755, exist_ok=True)
    return d


def _write_once(path: str, text: str) -> str:
    try:
        with open(path) as f:
            if f.read() == text:
                return path
    except OSError:
        pass
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def _etc_files(uid: int) -> dict[str, str]:
    """The sandbox's /etc beyond ld.so.cache and localtime: {path inside: host file}, generated, no host secrets."""
    d = os.path.join(state_dir(), "etc")
    name = "sandbox" if os.geteuid() == 0 else "user"
    files = {
        "/etc/passwd": (
            f"passwd-{uid}",
            "root:x:0:0:root:/root:/bin/bash\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
            f"{name}:x:{uid}:{uid}:{name}:/tmp:/bin/bash\n",
        ),
        "/etc/group": (f"group-{uid}", f"root:x:0:\nnogroup:x:65534:\n{name}:x:{uid}:\n"),
        "/etc/nsswitch.conf": ("nsswitch.conf", "passwd: files\ngroup: files\nshadow: files\nhosts: files\n"),
        "/etc/hosts": ("hosts", "127.0.0.1 localhost\n::1 localhost\n"),
    }
    return {inside: _write_once(os.path.join(d, fname), text) for inside, (fname, text) in files.items()}


class _UidLease:
    """A uid held by an exclusive flock on ``<state>/uids/<uid>.lock`` (any process, this one included: flock locks
    belong to the open file, so two Sandbox objects of one process conflict too). Released by :meth:`release` or
    when the holder dies."""

    def __init__(self, start: int, fixed: bool):
        d = os.path.join(state_dir(), "uids")
        os.makedirs(d, mode=0o700, exist_ok=True)
        for i in range(1 if fixed else UID_SPAN):
            uid = start if fixed else UID_BASE + (start - UID_BASE + i) % UID_SPAN
            fd = os.open(os.path.join(d, f"{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                continue
            self.uid, self._fd = uid, fd
            self._finalizer = weakref.finalize(self, os.close, fd)
            return
        raise RuntimeError(
            f"sandbox uid {start} is held by another live sandbox" if fixed else "every sandbox uid is in use"
        )

    def release(self) -> None:
        self._finalizer()  # idempotent


# -- the files a task sees ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Layout:
    """The system part of the sandbox's filesystem: ``dirs`` made (0755), host paths bound read-only at the same
    place (``files``: single files, ``trees``: whole directories), ``links`` (path -> target) as the host has them."""

    dirs: tuple[str, ...]
    files: tuple[str, ...]
    trees: tuple[str, ...]
    links: tuple[tuple[str, str], ...]

    @property
    def tops(self) -> tuple[str, ...]:
        """The top-level directories the layout fills (/usr, /etc): each its own tmpfs, read-only once filled."""
        return tuple(sorted({"/etc", "/usr"} | {"/" + d.strip("/").split("/")[0] for d in self.dirs}))

    def args(self) -> list[str]:
        out = []
        for t in self.tops:
            out += ["--perms", "0755", "--tmpfs", t]
        for d in self.dirs:
            out += ["--perms", "0755", "--dir", d]
        for p in (*self.trees, *self.files):
            out += ["--ro-bind", p, p]
        for path, target in self.links:
            out += ["--symlink", target, path]
        return out


def _resolve(path: str, links: dict[str, str]) -> str | None:
    """``path``'s real location, recording each symlink met on the way (every one at its real parent) in ``links``."""
    parts = [p for p in path.split("/") if p]
    cur, hops = "/", 0
    while parts:
        nxt = os.path.join(cur, parts.pop(0))
        if os.path.islink(nxt):
            hops += 1
            if hops > 40:
                return None
            target = os.readlink(nxt)
            links[nxt] = target
            base = "/" if target.startswith("/") else cur
            parts = [p for p in os.path.normpath(os.path.join(base, target)).split("/") if p] + parts
            cur = "/"
        elif os.path.lexists(nxt):
            cur = nxt
        else:
            return None
    return cur


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


_LDD_RE = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x[0-9a-f]+\)")


@functools.cache
def system_layout() -> Layout:
    """What the sandbox shows of the host, computed once per process: the :data:`TOOLS` found, ``python3`` and its
    standard library (not ``dist-packages`` nor ``/usr/local``), git's helpers, the time zones, every shared library
    ``ldd`` names for them (and ``libgcc_s``, which glibc loads for thread exit), ``/etc/ld.so.cache``."""
    links: dict[str, str] = {}
    files: set[str] = set()
    trees: set[str] = set()

    def add(path: str, tree: bool = False) -> str | None:
        real = _resolve(path, links)
        if real is not None:
            (trees if tree and os.path.isdir(real) else files).add(real)
        return real

    for p in ("/bin", "/sbin", "/lib", "/lib64"):  # merged /usr: the top-level links
        if os.path.islink(p):
            links[p] = os.readlink(p)
    for tool in TOOLS:
        found = shutil.which(tool, path="/usr/bin:/bin:/usr/sbin:/sbin")
        if found:
            add(found)
    scan = ["/usr/lib/git-core"]  # trees whose programs need libraries too
    py = _resolve("/usr/bin/python3", {})
    if py:
        ver = os.path.basename(py)  # python3.11
        for p in (f"/usr/lib/{ver}", f"/etc/{ver}"):  # /etc/python3.X holds the stdlib's sitecustomize.py
            if os.path.isdir(p):
                add(p, tree=True)
        scan.append(f"/usr/lib/{ver}/lib-dynload")
    for p in _TREES:
        if os.path.isdir(p):
            add(p, tree=True)
    for p in _ETC_FILES:
        if os.path.lexists(p):
            add(p)
    elves = [f for f in files if _is_elf(f)]
    for t in scan:
        for root, _, names in os.walk(t):
            elves += [os.path.join(root, n) for n in names if _is_elf(os.path.join(root, n))]
    elves = sorted(set(elves))
    libs = set()
    if elves and shutil.which("ldd"):
        for i in range(0, len(elves), 200):
            r = subprocess.run(
                ["ldd", *elves[i : i + 200]],
                capture_output=True,
                text=True,
                env={"LC_ALL": "C", "PATH": _PATH},
            )
            libs.update(_LDD_RE.findall(r.stdout))
    for lib in sorted(libs):
        real = add(lib)
        if real and os.path.basename(real).startswith("libc.so"):
            for extra in ("libgcc_s.so.1", "libnss_files.so.2"):
                if os.path.exists(os.path.join(os.path.dirname(lib), extra)):
                    add(os.path.join(os.path.dirname(lib), extra))
            # libc's own directory (/usr/lib/x86_64-linux-gnu) as one bind: shared libraries hold no project's
            # code (the visible-files scan checks), and one bind instead of ~60 makes every command ~20 ms faster
            add(os.path.dirname(real), tree=True)

    def under_tree(p: str) -> bool:
        return any(p.startswith(t + "/") for t in trees)

    files = {f for f in files if not under_tree(f) and f not in trees}
    link_items = {p: t for p, t in links.items() if not under_tree(p)}
    dirs = set()
    for p in (*files, *trees, *link_items):
        parent = os.path.dirname(p)
        while parent != "/" and parent not in dirs:
            dirs.add(parent)
            parent = os.path.dirname(parent)
    return Layout(
        dirs=tuple(sorted(dirs)),
        files=tuple(sorted(files)),
        trees=tuple(sorted(trees)),
        links=tuple(sorted(link_items.items())),
    )


# -- cgroups: memory and processes for the whole command ---------------------------------------------------------
@functools.cache
def _cgroup_parent(controller: str) -> str | None:
    """A writable cgroup v1 directory of ``controller`` to make the runs' cgroups in (under our own cgroup where we
    may, so a container's limits still hold), or None."""
    mount = f"/sys/fs/cgroup/{controller}"
    if not os.path.exists(os.path.join(mount, "cgroup.procs")):
        return None
    own = ""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                if controller in ctrls.split(","):
                    own = path
    except OSError:
        pass
    for base in dict.fromkeys((mount + own.rstrip("/"), mount)):
        d = os.path.join(base, "comprl_sandbox")
        try:
            os.makedirs(d, exist_ok=True)
            probe = os.path.join(d, f"probe-{os.getpid()}")
            os.mkdir(probe)
            os.rmdir(probe)
            return d
        except OSError:
            continue
    return None


def cgroup_mechanism() -> dict[str, bool]:
    """Which limits the whole tree gets from a cgroup here (``memory``, ``pids``); the rest fall back."""
    return {c: _cgroup_parent(c) is not None for c in ("memory", "pids")}


_RUN_IDS = itertools.count()
_STALE: list[str] = []  # run cgroups a process was still leaving when we removed them: retried later
_STALE_LOCK = threading.Lock()


class _Watch:
    """What run_capped polls during a run: ``poll()`` -> a reason to kill the whole command, or None."""

    interval = 0.05

    def poll(self) -> str | None:
        return None

    def start(self, pid: int) -> None:
        pass


class _RunCgroups(_Watch):
    """One run's memory and pids cgroups (whichever are usable): the launcher joins them before it execs bwrap, so
    every process of the command is in them; removed by :meth:`close` after killing what is left."""

    def __init__(self, lim: SandboxLimits, tag: str):
        self.dirs: dict[str, str] = {}
        self._oom_file = None
        try:
            mem = _cgroup_parent("memory")
            if mem:
                d = self._make(mem, tag)
                limit = str(lim.memory_mb << 20)
                _write(os.path.join(d, "memory.limit_in_bytes"), limit)
                if os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(d, "memory.memsw.limit_in_bytes"), limit)
                self.dirs["memory"] = d
                self._oom_file = os.path.join(d, "memory.oom_control")
            pids = _cgroup_parent("pids")
            if pids:
                d = self._make(pids, tag)
                _write(os.path.join(d, "pids.max"), str(lim.processes + _PID_OVERHEAD))
                self.dirs["pids"] = d
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _make(parent: str, tag: str) -> str:
        d = os.path.join(parent, tag)
        os.mkdir(d)
        return d

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]

    def poll(self) -> str | None:
        if self._oom_file is None:
            return None
        try:
            with open(self._oom_file) as f:
                stats = dict(line.split() for line in f if line.strip())
        except OSError:
            return None
        if int(stats.get("oom_kill", 0)) > 0 or int(stats.get("under_oom", 0)) > 0:
            return "memory"
        return None

    def close(self) -> None:
        for d in self.dirs.values():
            _remove_cgroup(d)
        self.dirs = {}
        with _STALE_LOCK:
            left = list(_STALE)
            _STALE.clear()
        for d in left:
            _remove_cgroup(d)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _remove_cgroup(d: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(os.path.join(d, "cgroup.procs")) as f:
                pids = [int(x) for x in f.read().split()]
        except FileNotFoundError:
            return
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not pids:
            try:
                os.rmdir(d)
                return
            except FileNotFoundError:
                return
            except OSError:
                pass
        if time.monotonic() > deadline:
            with _STALE_LOCK:
                _STALE.append(d)
            return
        time.sleep(0.01)


class _RssWatch(_Watch):
    """The fallback where no memory cgroup is usable: sums the anonymous and shared resident memory of the command's
    process tree (bwrap's descendants; a process that leaves its session is still one, reparented to the namespace's
    PID 1) and says "memory" past the limit."""

    interval = 0.05

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        self.pid: int | None = None

    def start(self, pid: int) -> None:
        self.pid = pid

    def usage(self) -> int:
        if self.pid is None:
            return 0
        children: dict[int, list[int]] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(name))
        total, todo = 0, [self.pid]
        while todo:
            pid = todo.pop()
            todo += children.get(pid, [])
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith(("RssAnon:", "RssShmem:")):
                            total += int(line.split()[1]) << 10
            except OSError:
                continue
        return total

    def poll(self) -> str | None:
        return "memory" if self.usage() > self.limit else None


# -- the sandbox ---------------------------------------------------------------------------------------------------
class Sandbox:
    """Runs commands in ``workdir`` (mounted at ``/repo``, the only writable path) under ``limits``.

    ``ro_paths``: more host paths mounted read-only at the same place (an interpreter's environment, say); none may
    lie above ``workdir`` or hold other tasks' copies. ``env``: variables set inside (PATH, HOME=/tmp and LANG are
    set already). As root the sandbox holds its uid (from a registry shared by every process) until :meth:`close`
    (idempotent; garbage collection does it too)."""

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
        self._lease: _UidLease | None = None
        if self.root:
            start = uid if uid is not None else UID_BASE + zlib.crc32(self.workdir.encode()) % UID_SPAN
            self._lease = _UidLease(start, fixed=uid is not None)
            self.uid = self._lease.uid
            _chown_tree(self.workdir, self.uid)
        else:
            self.uid = os.geteuid()
        self._etc = _etc_files(self.uid)
        self._seccomp = seccomp.program_file(state_dir())
        self.closed = False

    def close(self) -> None:
        """Gives the uid back to the registry (idempotent). The sandbox runs nothing after it."""
        self.closed = True
        if self._lease is not None:
            self._lease.release()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def argv(
        self, command: str, limits: SandboxLimits | None = None, cgroup_procs: tuple[str, ...] = ()
    ) -> list[str]:
        """The whole launch: the host-side launcher (joins ``cgroup_procs``, opens the seccomp program on fd 9),
        bwrap, setpriv, prlimit, ``bash -c command``."""
        lim = limits or self.limits
        launch = (
            'b=$1; shift; for f do shift; [ "$f" = -- ] && break; '
            'echo $$ > "$f" || { echo "sandbox: cannot join cgroup $f" >&2; exit 125; }; done; '
            f'exec "$@" {_SECCOMP_FD}<"$b"'
        )
        out = ["/bin/sh", "-c", launch, "sandbox-launch", self._seccomp, *cgroup_procs, "--"]
        out += ["bwrap", "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
        out += ["--seccomp", str(_SECCOMP_FD)]
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
        layout = system_layout()
        out += layout.args()
        for inside, host in self._etc.items():
            out += ["--ro-bind", host, inside]
        out += ["--dev", "/dev", "--proc", "/proc"]
        out += ["--size", str(lim.tmp_mb << 20), "--perms", "1777", "--tmpfs", "/tmp"]
        made = set(layout.dirs) | set(layout.tops) | {"/tmp", "/dev", "/proc"}
        for p in self.ro_paths:  # after /tmp's tmpfs, which would hide a path under /tmp
            # bwrap makes missing parents 0700 (root's), which the sandbox's uid could not cross: make them 0755
            parts = p.strip("/").split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/" + "/".join(parts[:i])
                if d not in made and not any(d == t or d.startswith(t + "/") for t in layout.trees):
                    out += ["--perms", "0755", "--dir", d]
                    made.add(d)
            out += ["--ro-bind", p, p]
        for t in layout.tops:  # filled: writing there is EROFS, not just EACCES
            out += ["--remount-ro", t]
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
        if self.closed:
            raise RuntimeError("this Sandbox was closed (its uid went back to the registry)")
        lim = limits or self.limits
        try:
            cg = _RunCgroups(lim, f"run-{os.getpid()}-{self.uid}-{next(_RUN_IDS)}")
        except OSError:
            cg = None  # a cgroup we could make but not set up (a delegated hierarchy's rules): fall back
        watches: list[_Watch] = []
        if cg is not None:
            watches.append(cg)
        if cg is None or "memory" not in cg.dirs:
            watches.append(_RssWatch(lim.memory_mb << 20))
        try:
            argv = self.argv(command, lim, tuple(cg.procs_files) if cg else ())
            return run_capped(argv, lim, stdin=stdin, watches=watches)
        finally:
            if cg is not None:
                cg.close()


def run_capped(
    argv: list[str], lim: SandboxLimits, stdin: bytes | None = None, watches: list[_Watch] | tuple = ()
) -> Result:
    """Runs ``argv`` in its own process group (one killpg ends setpriv/prlimit/bwrap, or the runtime's exec) and
    reads its merged output under ``lim``: keep ``output_bytes``, count the rest, kill the group past
    ``drain_bytes`` or ``wall_s``, or when a watch says so (``killed`` = its reason); reaps it and says how it ended.
    Both backends run through it (container.py). ``stdin``: bytes fed to the command (a file the editor writes),
    from a thread so a command that prints before it reads cannot deadlock against us; none: ``/dev/null``."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    for w in watches:
        w.start(proc.pid)
    if stdin is not None:
        threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
    buf = bytearray()
    dropped, killed = 0, None
    tick = min([w.interval for w in watches], default=0.5)
    next_poll = t0
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        while True:
            now = time.monotonic()
            left = lim.wall_s - (now - t0)
            if left <= 0:
                killed = "wall"
                break
            if watches and now >= next_poll:
                next_poll = now + tick
                killed = next((r for w in watches if (r := w.poll())), None)
                if killed:
                    break
            if not sel.select(timeout=min(left, tick)):
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
    if killed is None:
        # the kernel's OOM killer may have ended a process just before the command exited
        killed = next((r for w in watches if isinstance(w, _RunCgroups) and (r := w.poll())), None)
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
