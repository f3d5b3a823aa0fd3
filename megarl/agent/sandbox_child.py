"""The sandboxed child: confines itself, then runs the code it reads from stdin.

Started by `megarl.agent.sandbox` as `python -I sandbox_child.py SCRATCH LIMITS_JSON PARENT_PID`, in
SCRATCH, with stdout and stderr going to files there; it dies with the thread that started it. It
imports nothing of megarl (a fresh interpreter stays small and starts in ~30 ms) and confines itself
in this order, before the untrusted code runs:

1. resource limits (always): CPU seconds, address space, processes, file size, no core dumps;
2. kernel isolation where the machine allows it (best effort, each step skipped if refused): new user,
   network and mount namespaces (no network interface but a downed loopback), every mount made
   read-only recursively, and SCRATCH bind-mounted writable again;
3. a Python audit hook (always): refuses sockets, starting processes, signalling other processes,
   changing resource limits, loading ctypes, and writing, creating or removing files outside SCRATCH.

The audit hook is what holds where namespaces are refused (e.g. a container without user namespaces);
it is a guard against accidents and naive attacks, not a security boundary (see docs/running.md, "Sandbox").
"""

import json
import os
import resource
import signal
import sys
import traceback
from types import SimpleNamespace

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
MOUNT_ATTR_RDONLY, AT_FDCWD, AT_RECURSIVE = 0x1, -100, 0x8000
PR_SET_PDEATHSIG = 1
SYS_MOUNT_SETATTR = 442  # the same number on x86-64 and aarch64 (new syscalls share one table)

WRITE_EVENTS = {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
                "os.chflags", "os.mkfifo", "os.mknod", "shutil.rmtree", "shutil.chown"}
TWO_PATH_EVENTS = {"os.rename", "os.link", "os.symlink", "shutil.copyfile", "shutil.copytree", "shutil.move"}
PROCESS_EVENTS = {"os.fork", "os.forkpty", "os.system", "os.posix_spawn", "os.exec", "os.spawn", "os.kill",
                  "os.killpg", "subprocess.Popen", "pty.spawn", "signal.pthread_kill"}
LIMIT_EVENTS = {"resource.setrlimit", "resource.prlimit"}  # root outside a user namespace could lift them
BLOCKED_IMPORTS = {"ctypes", "_ctypes"}  # foreign calls go around every audit event
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def isolate_namespaces(scratch: str) -> None:
    """Enter new user, network and mount namespaces and make everything but `scratch` read-only, as far
    as the kernel allows (a refused step leaves the steps after it out)."""
    import ctypes  # here, not at the top: `forget_ctypes` must find no reference to it

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS) != 0:
        return
    path = scratch.encode()
    if (libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0
            and libc.mount(path, path, None, MS_BIND | MS_REC, None) == 0):
        read_only, writable = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0), MountAttr(0, MOUNT_ATTR_RDONLY, 0, 0)
        if libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(read_only),
                        ctypes.sizeof(read_only)) == 0:
            libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path, AT_RECURSIVE, ctypes.byref(writable),
                         ctypes.sizeof(writable))


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that started it ends, so that a trainer that dies mid-call
    leaves no sandbox behind. Set after the namespaces: entering a user namespace clears it."""
    import ctypes

    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)


def forget_ctypes() -> None:
    """Drop the ctypes this setup loaded, so that the code's `import ctypes` is a new import, which the
    audit hook refuses (an import of a module already loaded raises no audit event)."""
    for name in [name for name in sys.modules if name.split(".")[0] in BLOCKED_IMPORTS]:
        del sys.modules[name]


def _tasks_of_this_user() -> int:
    """Processes and threads of this real uid: RLIMIT_NPROC counts them all, machine-wide."""
    uid, count = os.getuid(), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, KeyError, ValueError):  # the process ended while being read
            continue
    return count


def set_limits(limits: SimpleNamespace) -> None:
    """Kernel resource limits; the kernel does not apply RLIMIT_NPROC to root (the audit hook does)."""
    memory = limits.memory_mib << 20
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_mib << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    allowed = _tasks_of_this_user() + limits.max_processes
    resource.setrlimit(resource.RLIMIT_NPROC, (allowed, allowed))


def _written_paths(event: str, args: tuple) -> tuple:
    """The paths an audit event would create, change or remove."""
    if event == "open":
        path, mode, flags = args
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & WRITE_FLAGS)
        return (path,) if writes and path is not None else ()
    if event in TWO_PATH_EVENTS:
        return args[:2]
    return args[:1] if event in WRITE_EVENTS else ()


def install_audit_hook(scratch: str) -> None:
    """Refuse network, new processes, new limits, ctypes and writes outside `scratch` from here on."""
    inside = os.path.realpath(scratch) + os.sep

    def outside(path) -> bool:
        if isinstance(path, int):  # an open descriptor (os.chmod(fd)...), opened under this hook
            return False
        return not (os.path.realpath(os.fsdecode(path)) + os.sep).startswith(inside)

    def hook(event: str, args: tuple) -> None:
        if event.startswith("socket."):
            raise PermissionError(f"sandbox: no network ({event})")
        if event in PROCESS_EVENTS:
            raise PermissionError(f"sandbox: no new processes or signals ({event})")
        if event in LIMIT_EVENTS:
            raise PermissionError(f"sandbox: resource limits are fixed ({event})")
        if event == "import" and args[0] in BLOCKED_IMPORTS:
            raise ImportError(f"sandbox: module {args[0]!r} is not available")
        for path in _written_paths(event, args):
            if outside(path):
                raise PermissionError(f"sandbox: writing outside the scratch directory ({event} {path})")

    sys.addaudithook(hook)


def main() -> None:
    scratch, limits, parent_pid = sys.argv[1], SimpleNamespace(**json.loads(sys.argv[2])), int(sys.argv[3])
    set_limits(limits)  # before the user namespace, which takes its process cap from RLIMIT_NPROC now
    if limits.namespaces:  # `limits` holds a SandboxConfig's fields
        isolate_namespaces(scratch)
        os.chdir(scratch)  # the working directory still pointed below the bind mount, at the read-only one
    die_with_parent(parent_pid)
    forget_ctypes()
    code = sys.stdin.read()
    install_audit_hook(scratch)
    sys.argv = ["main.py"]
    try:
        exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as exc:  # the code's own error (MemoryError included) is output for the model
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)  # from the code's frame on
        sys.exit(1)


if __name__ == "__main__":
    main()
