"""The seccomp filter the SWE sandbox hands to ``bwrap --seccomp FD`` (issue 32 point 4b), built by hand as classic BPF.

Denied inside the sandbox (everything else is allowed):

| syscall | answer | why |
|---|---|---|
| ``unshare`` with any ``CLONE_NEW*`` flag | EPERM | a user namespace gives uid 0 with every capability in it (``unshare -r``) |
| ``clone`` with any ``CLONE_NEW*`` flag | EPERM | the same, through ``clone`` |
| ``clone3`` | ENOSYS | its flags live in memory a filter cannot read: glibc falls back to ``clone``, checked above |
| ``setns`` | EPERM | joining another namespace |
| ``keyctl``, ``add_key``, ``request_key`` | EPERM | kernel keyrings outlive the sandbox (a key left for the next episode) |
| another ABI (i386 ``int 0x80``, x32) | EPERM | the syscall numbers above would not apply |

The program checks ``seccomp_data.arch`` first. Built for x86_64 and aarch64; elsewhere :func:`program` raises
:class:`UnsupportedArch`.
"""

from __future__ import annotations

import errno
import hashlib
import os
import platform
import struct
import tempfile

# classic BPF opcodes (linux/filter.h)
_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x05 | 0x30 | 0x00  # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x05 | 0x40 | 0x00  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06

RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6] (little-endian: low word first)
_OFF_NR, _OFF_ARCH, _OFF_ARG0_LO = 0, 4, 16

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWTIME = 0x00000080  # unshare/clone3 only: in clone's flags the low byte is the exit signal
_NS_CLONE = CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID
_NS_CLONE |= CLONE_NEWNET
_NS_UNSHARE = _NS_CLONE | CLONE_NEWTIME

# (AUDIT_ARCH, first number of a foreign ABI sharing it or None, syscall numbers)
ARCHES = {
    "x86_64": (
        0xC000003E,
        0x40000000,  # __X32_SYSCALL_BIT: x32 calls carry the x86_64 arch
        dict(clone=56, unshare=272, setns=308, clone3=435, add_key=248, request_key=249, keyctl=250),
    ),
    "aarch64": (
        0xC00000B7,
        None,
        dict(clone=220, unshare=97, setns=268, clone3=435, add_key=217, request_key=218, keyctl=219),
    ),
}


class UnsupportedArch(RuntimeError):
    """No filter is built for this machine's architecture."""


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def program(arch: str | None = None) -> bytes:
    """The filter as ``struct sock_filter[]`` bytes (what bwrap's ``--seccomp`` reads)."""
    arch = arch or platform.machine()
    if arch not in ARCHES:
        raise UnsupportedArch(
            f"the SWE sandbox's seccomp filter is built for {sorted(ARCHES)} only, not {arch!r}: add its syscall "
            "numbers to comprl_jax/envs/swe/seccomp.py ARCHES"
        )
    audit, foreign, nr = ARCHES[arch]
    eperm = RET_ERRNO | errno.EPERM
    # Straight-line code; BPF jumps only forward, so the flag checks (clone, unshare) come after the dispatch and
    # the shared returns (EPERM, ENOSYS) last.
    body: list[tuple] = [
        ("ld", _OFF_ARCH),
        ("jeq", audit, None, "eperm"),  # another ABI: refuse everything
        ("ld", _OFF_NR),
    ]
    if foreign is not None:
        body.append(("jge", foreign, "eperm", None))
    body += [
        ("jeq", nr["clone3"], "enosys", None),
        ("jeq", nr["clone"], "clone", None),
        ("jeq", nr["unshare"], "unshare", None),
        ("jeq", nr["setns"], "eperm", None),
        ("jeq", nr["keyctl"], "eperm", None),
        ("jeq", nr["add_key"], "eperm", None),
        ("jeq", nr["request_key"], "eperm", None),
        ("ret", RET_ALLOW),
        ("label", "clone"),
        ("ld", _OFF_ARG0_LO),
        ("jset", _NS_CLONE, "eperm", None),
        ("ret", RET_ALLOW),
        ("label", "unshare"),
        ("ld", _OFF_ARG0_LO),
        ("jset", _NS_UNSHARE, "eperm", None),
        ("ret", RET_ALLOW),
        ("label", "eperm"),
        ("ret", eperm),
        ("label", "enosys"),
        ("ret", RET_ERRNO | errno.ENOSYS),
    ]
    labels, pc = {}, 0
    for op in body:
        if op[0] == "label":
            labels[op[1]] = pc
        else:
            pc += 1
    out, pc = [], 0
    for op in body:
        kind = op[0]
        if kind == "label":
            continue
        if kind == "ld":
            out.append(_ins(_LD_W_ABS, op[1]))
        elif kind == "ret":
            out.append(_ins(_RET_K, op[1]))
        else:
            code = {"jeq": _JEQ_K, "jge": _JGE_K, "jset": _JSET_K}[kind]
            jt = 0 if op[2] is None else labels[op[2]] - pc - 1
            jf = 0 if op[3] is None else labels[op[3]] - pc - 1
            assert 0 <= jt < 256 and 0 <= jf < 256
            out.append(_ins(code, op[1], jt, jf))
        pc += 1
    return b"".join(out)


_PATHS: dict[str, str] = {}


def program_file(state_dir: str) -> str:
    """:func:`program` written once (content-addressed) under ``state_dir``: bwrap reads it from an fd the launcher
    opens per run (a shared fd's offset would be at EOF for the second run)."""
    if state_dir in _PATHS and os.path.exists(_PATHS[state_dir]):
        return _PATHS[state_dir]
    data = program()
    path = os.path.join(state_dir, f"seccomp-{hashlib.sha1(data).hexdigest()[:16]}.bpf")
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(dir=state_dir, prefix=".seccomp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    _PATHS[state_dir] = path
    return path
