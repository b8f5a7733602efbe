"""The seccomp filter bubblewrap installs on every job: a small, hand-built classic BPF program.

bubblewrap (``--seccomp FD``) loads a compiled filter and applies it to the
agent and everything it starts, after it has set up the namespaces. The
filter allows every system call except these, which fail with ``EPERM``:

- new namespaces: ``unshare``, ``setns``, and ``clone`` with any
  ``CLONE_NEW*`` flag (a completion must not get a user namespace with full
  capabilities, the door to most kernel privilege escalations);
  ``clone3`` fails with ``ENOSYS`` because its flags live in memory a filter
  cannot read, and glibc then falls back to ``clone``;
- other processes and the kernel's keyrings: ``ptrace``,
  ``process_vm_readv``/``writev``, ``keyctl``, ``add_key``, ``request_key``;
- kernel attack surface no test needs: ``bpf``, ``perf_event_open``,
  ``userfaultfd``, ``io_uring_*``, module and kexec calls, ``mount`` and the
  new mount API, ``pivot_root``, ``chroot``, ``swapon``/``off``, ``reboot``,
  ``syslog``, ``acct``, ``quotactl``, handle-based opens, ``iopl``/``ioperm``.

A call from another ABI (x32 on x86-64, or any foreign architecture) kills
the process: the syscall numbers above would not mean the same thing there.
Supported hosts: x86-64 and aarch64 (``filter_bytes`` raises elsewhere, and
the backend then reports bubblewrap as unusable).

The same effect as libseccomp's ``seccomp_export_bpf`` with a deny list, in
60 lines and without a C dependency; ``tests/integration/reward_server/test_sandbox_hardening.py``
checks each class of call from inside a real sandbox.
"""

from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (little-endian hosts).
OFF_NR, OFF_ARCH, OFF_ARG0 = 0, 4, 16
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
X32_SYSCALL_BIT = 0x40000000
CLONE_NEW_FLAGS = (0x00020000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
                   | 0x02000000 | 0x00000080)  # NEWNS UTS IPC USER PID NET CGROUP TIME

DENIED = (
    "unshare", "setns", "ptrace", "process_vm_readv", "process_vm_writev", "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "mount", "umount2",
    "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
    "mount_setattr", "swapon", "swapoff", "reboot", "syslog", "acct", "quotactl", "name_to_handle_at",
    "open_by_handle_at", "iopl", "ioperm",
)

# (AUDIT_ARCH_*, whether x32 numbers must be refused, syscall numbers). From the kernel's unistd tables.
ARCHES = {
    "x86_64": (0xC000003E, True, {
        "clone": 56, "clone3": 435, "unshare": 272, "setns": 308, "ptrace": 101, "process_vm_readv": 310,
        "process_vm_writev": 311, "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321,
        "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "init_module": 175, "finit_module": 313, "delete_module": 176,
        "kexec_load": 246, "kexec_file_load": 320, "mount": 165, "umount2": 166, "pivot_root": 155,
        "chroot": 161, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "move_mount": 429,
        "open_tree": 428, "mount_setattr": 442, "swapon": 167, "swapoff": 168, "reboot": 169, "syslog": 103,
        "acct": 163, "quotactl": 179, "name_to_handle_at": 303, "open_by_handle_at": 304, "iopl": 172,
        "ioperm": 173,
    }),
    "aarch64": (0xC00000B7, False, {
        "clone": 220, "clone3": 435, "unshare": 97, "setns": 268, "ptrace": 117, "process_vm_readv": 270,
        "process_vm_writev": 271, "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280,
        "perf_event_open": 241, "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "init_module": 105, "finit_module": 273, "delete_module": 106,
        "kexec_load": 104, "kexec_file_load": 294, "mount": 40, "umount2": 39, "pivot_root": 41,
        "chroot": 51, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "move_mount": 429,
        "open_tree": 428, "mount_setattr": 442, "swapon": 224, "swapoff": 225, "reboot": 142, "syslog": 116,
        "acct": 89, "quotactl": 60, "name_to_handle_at": 264, "open_by_handle_at": 265,
    }),
}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)  # struct sock_filter


def filter_bytes(machine: str | None = None) -> bytes:
    """The compiled filter (``struct sock_filter[]``) for this host's architecture."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise RuntimeError(f"no seccomp filter for architecture {machine}")
    audit_arch, refuse_x32, numbers = ARCHES[machine]
    denied = [numbers[name] for name in DENIED if name in numbers]
    # Layout: arch check, [x32 check], one JEQ per denied call, clone, clone3, allow, clone's flag
    # check (2), then the three verdicts. Jump offsets count instructions after the jump.
    head = [(BPF_LD_W_ABS, OFF_ARCH, 0, 0), (BPF_JEQ_K, audit_arch, 0, "kill"), (BPF_LD_W_ABS, OFF_NR, 0, 0)]
    if refuse_x32:
        head.append((BPF_JGE_K, X32_SYSCALL_BIT, "kill", 0))
    body = [(BPF_JEQ_K, nr, "eperm", 0) for nr in denied]
    body += [(BPF_JEQ_K, numbers["clone"], "clone", 0), (BPF_JEQ_K, numbers["clone3"], "enosys", 0),
             (BPF_RET_K, RET_ALLOW, 0, 0)]
    labels = {"clone": len(head) + len(body)}
    body += [(BPF_LD_W_ABS, OFF_ARG0, 0, 0), (BPF_JSET_K, CLONE_NEW_FLAGS, "eperm", 0), (BPF_RET_K, RET_ALLOW, 0, 0)]
    labels.update(eperm=len(head) + len(body), enosys=len(head) + len(body) + 1, kill=len(head) + len(body) + 2)
    tail = [(BPF_RET_K, RET_ERRNO | errno.EPERM, 0, 0), (BPF_RET_K, RET_ERRNO | errno.ENOSYS, 0, 0),
            (BPF_RET_K, RET_KILL_PROCESS, 0, 0)]
    program = []
    for i, (code, k, jt, jf) in enumerate(head + body + tail):
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
        if not (0 <= jt < 256 and 0 <= jf < 256):
            raise RuntimeError("seccomp filter jump out of range")  # the deny list grew past BPF's 8-bit jumps
        program.append(_insn(code, k, jt, jf))
    return b"".join(program)
