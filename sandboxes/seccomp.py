"""The local backend's seccomp filter: a classic-BPF program that bubblewrap loads
(`--seccomp FD`) right before it runs the sandboxed command.

It refuses, with EPERM, the syscalls a sandboxed agent has no business making and that
widen the kernel surface it can reach: mounting, namespaces (unshare, setns, clone with a
namespace flag; clone3 answers ENOSYS so libc falls back to clone, whose flags we can see),
ptrace and cross-process memory access, kernel modules, kexec, bpf, perf, keyrings,
io_uring, userfaultfd, clock setting, swap, reboot, quotas. It is the same idea as Docker's
default profile, written as a deny list so ordinary programs (python, pip, compilers, git)
run unchanged. Other architectures' syscalls (x32 included) kill the process.

Syscall numbers are per architecture; tests check the x86_64 table against the kernel
headers when they are installed.
"""

from __future__ import annotations

import errno
import functools
import platform
import struct

# Syscalls refused with EPERM, by name.
DENIED = (
    "mount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
    "open_tree", "mount_setattr", "unshare", "setns", "ptrace", "process_vm_readv",
    "process_vm_writev", "kcmp", "init_module", "finit_module", "delete_module", "kexec_load",
    "kexec_file_load", "bpf", "perf_event_open", "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "open_by_handle_at",
    "name_to_handle_at", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "swapon",
    "swapoff", "reboot", "sethostname", "setdomainname", "acct", "quotactl", "syslog",
    "lookup_dcookie", "vhangup",
)

SYSCALLS = {
    "x86_64": {
        "mount": 165, "umount2": 166, "pivot_root": 155, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "move_mount": 429, "open_tree": 428, "mount_setattr": 442,
        "unshare": 272, "setns": 308, "ptrace": 101, "process_vm_readv": 310,
        "process_vm_writev": 311, "kcmp": 312, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320, "bpf": 321,
        "perf_event_open": 298, "keyctl": 250, "add_key": 248, "request_key": 249,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "userfaultfd": 323,
        "open_by_handle_at": 304, "name_to_handle_at": 303, "settimeofday": 164,
        "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159, "swapon": 167, "swapoff": 168,
        "reboot": 169, "sethostname": 170, "setdomainname": 171, "acct": 163, "quotactl": 179,
        "syslog": 103, "lookup_dcookie": 212, "vhangup": 153, "clone": 56, "clone3": 435,
    },
    "aarch64": {
        "mount": 40, "umount2": 39, "pivot_root": 41, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "move_mount": 429, "open_tree": 428, "mount_setattr": 442,
        "unshare": 97, "setns": 268, "ptrace": 117, "process_vm_readv": 270,
        "process_vm_writev": 271, "kcmp": 272, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "kexec_load": 104, "kexec_file_load": 294, "bpf": 280,
        "perf_event_open": 241, "keyctl": 219, "add_key": 217, "request_key": 218,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "userfaultfd": 282,
        "open_by_handle_at": 265, "name_to_handle_at": 264, "settimeofday": 170,
        "clock_settime": 112, "clock_adjtime": 266, "adjtimex": 171, "swapon": 224, "swapoff": 225,
        "reboot": 142, "sethostname": 161, "setdomainname": 162, "acct": 89, "quotactl": 60,
        "syslog": 116, "lookup_dcookie": 18, "vhangup": 58, "clone": 220, "clone3": 435,
    },
}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 \
    | 0x20000000 | 0x40000000 | 0x00000080

# classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h)
LD_ABS_W = 0x20   # BPF_LD | BPF_W | BPF_ABS
JEQ_K = 0x15      # BPF_JMP | BPF_JEQ | BPF_K
JGE_K = 0x35      # BPF_JMP | BPF_JGE | BPF_K
JSET_K = 0x45     # BPF_JMP | BPF_JSET | BPF_K
RET_K = 0x06      # BPF_RET | BPF_K
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
RET_KILL_PROCESS = 0x80000000
# offsets in struct seccomp_data: nr, arch, instruction_pointer, args[6] (little-endian lows)
OFF_NR, OFF_ARCH, OFF_ARG0 = 0, 4, 16


def machine() -> str:
    m = platform.machine()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def supported() -> bool:
    return machine() in SYSCALLS


@functools.cache
def program(arch: str | None = None) -> bytes:
    """The filter as bytes of `struct sock_filter` (what `bwrap --seccomp FD` reads)."""
    arch = arch or machine()
    nrs = SYSCALLS[arch]
    insns: list[tuple[int, int, int, int]] = []

    def op(code, k=0, jt=0, jf=0):
        insns.append((code, jt, jf, k))

    # Jump targets are relative, so build the tail (return blocks) at fixed positions from the end.
    denied = [nrs[name] for name in DENIED]
    # Layout:
    #   0 ld arch; 1 jeq ARCH ? next : KILL; 2 ld nr; [3 jge X32 ? KILL : next  (x86_64 only)]
    #   clone3 -> ENOSYS; clone -> check flags; each denied -> EPERM; else ALLOW
    #   tail: ALLOW, EPERM, ENOSYS, KILL, then clone's flag check
    body: list[tuple[str, int]] = []  # (kind, nr) checks in order
    body.append(("enosys", nrs["clone3"]))
    body.append(("clone", nrs["clone"]))
    body += [("eperm", nr) for nr in denied]
    head = 3 + (1 if arch == "x86_64" else 0)
    n_body = len(body)
    allow_at = head + n_body          # ret ALLOW
    eperm_at = allow_at + 1           # ret ERRNO(EPERM)
    enosys_at = eperm_at + 1          # ret ERRNO(ENOSYS)
    kill_at = enosys_at + 1           # ret KILL_PROCESS
    clone_at = kill_at + 1            # ld arg0; jset NS flags; ret EPERM; ret ALLOW

    def rel(target: int, at: int) -> int:
        return target - at - 1

    op(LD_ABS_W, OFF_ARCH)
    op(JEQ_K, AUDIT_ARCH[arch], 0, rel(kill_at, 1))
    op(LD_ABS_W, OFF_NR)
    if arch == "x86_64":
        op(JGE_K, X32_SYSCALL_BIT, rel(kill_at, 3), 0)
    for i, (kind, nr) in enumerate(body):
        at = head + i
        target = {"enosys": enosys_at, "clone": clone_at, "eperm": eperm_at}[kind]
        op(JEQ_K, nr, rel(target, at), 0)
    op(RET_K, RET_ALLOW)
    op(RET_K, RET_ERRNO | errno.EPERM)
    op(RET_K, RET_ERRNO | errno.ENOSYS)
    op(RET_K, RET_KILL_PROCESS)
    op(LD_ABS_W, OFF_ARG0)  # clone's flags (the low 32 bits hold every namespace flag)
    op(JSET_K, CLONE_NAMESPACE_FLAGS, 0, 1)  # BPF jumps only forward: own return pair
    op(RET_K, RET_ERRNO | errno.EPERM)
    op(RET_K, RET_ALLOW)
    assert len(insns) == clone_at + 4 and max(max(i[1], i[2]) for i in insns) < 256
    return b"".join(struct.pack("<HBBI", *i) for i in insns)
