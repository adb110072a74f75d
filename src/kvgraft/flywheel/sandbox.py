"""The sandbox the code rung runs model-written programs in.

A program runs as `python -I -S -B main.py` (isolated mode: no user site, no site-packages, no `PYTHON*`
variables; only the standard library) in a separate process, in a new session, with stdin closed, an empty
environment but for `PATH` and `LC_ALL`, a fresh temporary directory as its working directory (removed after),
and these resource limits set in the child before exec: CPU seconds (`RLIMIT_CPU`), address space
(`RLIMIT_AS`), size of any file written (`RLIMIT_FSIZE`), processes (`RLIMIT_NPROC`), open files and no core
dumps. The parent reads stdout up to a byte limit and keeps a tail of stderr, under a wall-clock limit; on
timeout, overflow or the program's exit it kills the whole process group (and, when the program had its own
network namespace, every process left in that namespace, which a `setsid()` cannot escape).

How much more is isolated depends on the privileges the caller has (`SandboxResult` says which held):

- As root (`isolation="root"`): the child gets its own mount and network namespaces. The network namespace has
  only a loopback that is down: no connection, not even to 127.0.0.1, succeeds. Every mount is made read-only;
  the working directory is a size-limited tmpfs; the interpreter's own prefix stays readable at its path even
  when it lies under a private directory such as /root (the rest of that directory is hidden). The program then
  runs as `nobody`, so `RLIMIT_NPROC` bounds its processes (the kernel never enforces it for uid 0).
- Not root (`isolation="user"`): a user namespace gives the child its own network namespace where the OS allows
  unprivileged user namespaces. The program runs as the caller's user: it can read and write whatever that user
  can, and `RLIMIT_NPROC` counts all of that user's processes (so usually the program cannot fork at all).
- Neither (`isolation="none"`): only the limits, the session and the working directory; `network_isolated` is
  False, and the program has every right of the caller (root's too, as root in a container that forbids
  namespaces).

The level is found on first use (strongest first) and kept for the process: a level that worked once and fails
later (`nobody` at its process limit) gives the program an "error", never weaker isolation. Killed processes are
waited for (up to 2 s) until init reaps them, since until then they count against the next program's process
limit; concurrent sandboxes as root share that limit, as they all run as `nobody`.

Outcomes: "ok" (exit 0 and something printed; the answer is the last non-empty line), "no_output" (exit 0,
nothing printed), "error" (non-zero exit), "memory" (a `MemoryError` ended it), "timeout" (CPU or wall-clock
limit), "output_too_large" (stdout over its limit), "killed" (any other signal). Nothing the program does raises.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from kvgraft.core.errors import BadInputError, KvgraftError

Outcome = Literal["ok", "no_output", "error", "timeout", "memory", "output_too_large", "killed"]
Isolation = Literal["root", "user", "none"]

_MIB = 1024 * 1024
_STDERR_TAIL = 4096
_NOBODY = 65534
_PROGRAM = "main.py"
_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}

# Linux constants (include/uapi/linux/sched.h, mount.h); mount_setattr has number 442 on every architecture.
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
_AT_FDCWD, _AT_RECURSIVE = -100, 0x8000
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID = 0x1, 0x2
_SYS_MOUNT_SETATTR = 442


class SandboxError(KvgraftError):
    """The sandbox itself could not start a program (no interpreter, no temporary directory)."""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """What a sandboxed program may use.

    Attributes:
        cpu_s: CPU seconds per process (`RLIMIT_CPU`; SIGXCPU then ends it).
        memory_bytes: address space per process (`RLIMIT_AS`).
        output_bytes: stdout kept; more ends the program as "output_too_large".
        wall_s: wall-clock seconds for the whole run.
        file_bytes: largest file the program may write (`RLIMIT_FSIZE`).
        dir_bytes: size of its working directory when it is a tmpfs (root only).
        max_processes: `RLIMIT_NPROC` (processes and threads of the program's user).
    """

    cpu_s: int = 5
    memory_bytes: int = 512 * _MIB
    output_bytes: int = 64 * 1024
    wall_s: float = 10.0
    file_bytes: int = _MIB
    dir_bytes: int = 8 * _MIB
    max_processes: int = 8

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise BadInputError(f"sandbox limit {name} must be positive, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SandboxResult:
    """How one program ended.

    Attributes:
        outcome: see the module docstring.
        answer: the last non-empty line of stdout, stripped, when the outcome is "ok"; else None.
        stdout: what it printed (at most `output_bytes`, decoded as UTF-8 with replacement).
        stderr_tail: the last 4 KiB of its stderr.
        exit_code: its exit status; minus the signal number when a signal ended it; None when it was killed
            by the sandbox.
        wall_s: seconds from start to end.
        isolation: which privileges it ran under ("root", "user", "none").
        network_isolated: whether it had its own network namespace.
        filesystem_isolated: whether every mount but its working directory was read-only and it ran as nobody.
    """

    outcome: Outcome
    answer: str | None
    stdout: str
    stderr_tail: str
    exit_code: int | None
    wall_s: float
    isolation: Isolation
    network_isolated: bool
    filesystem_isolated: bool

    def to_json(self) -> dict[str, Any]:
        """Returns: every field by name."""
        return asdict(self)


_PYTHON_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.IGNORECASE | re.DOTALL)
_BARE_FENCE = re.compile(r"```[ \t]*\n(.*?)```", re.DOTALL)


def extract_program(text: str) -> str | None:
    """The Python program in a model's output.

    Args:
        text: the output.

    Returns:
        The last complete ```python (or ```py) fenced block; without one, the last complete fence with no
        language; None when there is neither or the block is blank. A fence left open (an output cut by its
        budget) does not count.
    """
    for fence in (_PYTHON_FENCE, _BARE_FENCE):
        blocks = [block for block in fence.findall(text) if block.strip()]
        if blocks:
            return str(blocks[-1])
    return None


class _Libc:
    """The few libc calls the child makes, resolved in the parent (the child between fork and exec should not
    load libraries)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.unshare = libc.unshare
        self.mount = libc.mount
        self.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        self.syscall = libc.syscall
        # struct mount_attr {u64 attr_set, attr_clr, propagation, userns_fd}
        self.read_only = (ctypes.c_uint64 * 4)(_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID, 0, 0, 0)

    def check(self, result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _interpreter() -> str:
    """The real interpreter this process runs on (not a venv's link: a venv may lie where nobody can read)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _hidden_ancestor(path: str) -> str | None:
    """The highest ancestor of `path` that others cannot enter (mode without o+x), or None."""
    parts = Path(path).parts
    for depth in range(2, len(parts) + 1):
        ancestor = os.path.join(*parts[:depth])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def _set_limits(limits: SandboxLimits) -> None:
    """In the child: the resource limits (hard CPU limit one second above the soft one, so SIGXCPU comes first)."""
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _root_setup(libc: _Libc, workdir: str, code: bytes, limits: SandboxLimits) -> Callable[[], None]:
    """The child's setup as root: namespaces, read-only mounts, a tmpfs working directory, then nobody."""
    prefix = os.path.realpath(sys.base_prefix)
    hidden = _hidden_ancestor(prefix)
    tmpfs_options = f"size={limits.dir_bytes},mode=0700,uid={_NOBODY},gid={_NOBODY}".encode()

    def setup() -> None:
        libc.check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET), "unshare")
        libc.check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount private")
        if hidden is not None:
            # Cover the private directory, then bring back only the interpreter's prefix at its own path
            # (a shared libpython is found by an rpath that names it).
            keep = os.open(prefix, os.O_PATH)
            libc.check(libc.mount(b"tmpfs", hidden.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=0755"), "tmpfs")
            os.makedirs(prefix, mode=0o755)
            libc.check(
                libc.mount(f"/proc/self/fd/{keep}".encode(), prefix.encode(), None, _MS_BIND | _MS_REC, None), "bind"
            )
            os.close(keep)
        # syscall() is variadic: every argument goes as a full long, as the kernel reads them.
        number, dirfd, flags, size = (ctypes.c_long(n) for n in (_SYS_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE, 32))
        read_only = ctypes.byref(libc.read_only)
        libc.check(libc.syscall(number, dirfd, b"/", flags, read_only, size), "mount_setattr")
        libc.check(libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, tmpfs_options), "tmpfs")
        os.chdir(workdir)
        _write_program(code)
        _set_limits(limits)
        os.setgroups([])
        os.setgid(_NOBODY)
        os.setuid(_NOBODY)

    return setup


def _user_setup(libc: _Libc, limits: SandboxLimits) -> Callable[[], None]:
    """The child's setup without root: its own network namespace inside a user namespace, then the limits."""

    def setup() -> None:
        libc.check(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET), "unshare")
        _set_limits(limits)

    return setup


def _write_program(code: bytes) -> None:
    """Writes the program into the current directory, readable by all (it runs as another user as root)."""
    fd = os.open(_PROGRAM, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, code)
    finally:
        os.close(fd)


_levels_that_failed: set[Isolation] = set()
_levels_that_worked: set[Isolation] = set()


class _StartFailed(Exception):
    """A level that worked before failed to start a program this time (say, `nobody` is at its process limit,
    which a program that forked can cause): the program gets no answer rather than weaker isolation."""


def _levels() -> list[Isolation]:
    """The isolation levels to try, strongest first, without those that already failed in this process."""
    levels: list[Isolation] = ["root", "user", "none"] if os.geteuid() == 0 else ["user", "none"]
    return [level for level in levels if level not in _levels_that_failed]


def _start(code: bytes, workdir: str, limits: SandboxLimits) -> tuple[subprocess.Popen[bytes], Isolation]:
    """Starts the program under the strongest isolation this machine allows.

    A level that fails on its first use in this process is not tried again; one that worked before and fails now
    raises `_StartFailed` instead of falling back to a weaker level.
    """
    libc = _Libc()
    argv = [_interpreter(), "-I", "-S", "-B", _PROGRAM]
    for level in _levels():
        if level == "root":
            setup = _root_setup(libc, workdir, code, limits)
        else:
            if not os.path.exists(os.path.join(workdir, _PROGRAM)):
                _write_program_at(workdir, code)
            setup = _user_setup(libc, limits) if level == "user" else (lambda: _set_limits(limits))
        try:
            process = subprocess.Popen(
                argv,
                cwd=workdir,
                env=_ENV,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=setup,
            )
        except (subprocess.SubprocessError, OSError) as exc:
            if level in _levels_that_worked:
                raise _StartFailed(str(exc)) from exc
            if level == "none":
                raise SandboxError(f"cannot start a sandboxed program: {exc}") from exc
            _levels_that_failed.add(level)
            continue
        _levels_that_worked.add(level)
        return process, level
    raise SandboxError("cannot start a sandboxed program: no isolation level works")


def _write_program_at(workdir: str, code: bytes) -> None:
    """Writes the program into its working directory from the parent (the levels without a tmpfs)."""
    Path(workdir, _PROGRAM).write_bytes(code)


def _netns(pid: int) -> str | None:
    """The network namespace of a process (its `ns/net` link), or None when it is gone."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _group_of(pid: int) -> tuple[int, bool] | None:
    """(process group, whether it is a zombie: dead, only waiting to be reaped) of a process; None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[2]), fields[0] == b"Z"


def _sweep(pgid: int, netns: str | None) -> set[int]:
    """Kills the program's process group and, given its own network namespace, every process in it, until none
    is left alive (a fork between the scan and the kill is found by the next scan; the limits bound how many).

    Returns:
        The ids of every process of the group or namespace it saw, zombies included.
    """
    seen: set[int] = set()
    for _ in range(1000):
        alive = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            found = _group_of(int(entry))
            if found is None:
                continue
            group, zombie = found
            if group == pgid or (not zombie and netns is not None and _netns(int(entry)) == netns):
                seen.add(int(entry))
                if not zombie:
                    alive.append(int(entry))
        if not alive:
            break
        for pid in alive:
            with contextlib.suppress(OSError):  # gone since the scan
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    return seen


def _await_reaped(pids: set[int], timeout_s: float = 2.0) -> None:
    """Waits (a bounded time) until the program's dead processes are reaped by their new parent (init): until then
    they still count against the next program's `RLIMIT_NPROC`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in pids):
        time.sleep(0.01)


class _Reader:
    """Reads stdout (up to a limit) and the tail of stderr of a running program."""

    def __init__(self, process: subprocess.Popen[bytes], output_bytes: int) -> None:
        assert process.stdout is not None and process.stderr is not None
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.output_bytes = output_bytes
        self.selector = selectors.DefaultSelector()
        self.selector.register(process.stdout, selectors.EVENT_READ, self.stdout)
        self.selector.register(process.stderr, selectors.EVENT_READ, self.stderr)

    def open(self) -> bool:
        return bool(self.selector.get_map())

    def read(self, timeout: float) -> bool:
        """Reads what is ready within `timeout` seconds. Returns: False when stdout went over its limit."""
        for key, _ in self.selector.select(timeout):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                self.selector.unregister(key.fileobj)
                continue
            buffer: bytearray = key.data
            buffer += chunk
            if buffer is self.stderr and len(buffer) > _STDERR_TAIL:
                del buffer[:-_STDERR_TAIL]
            if buffer is self.stdout and len(buffer) > self.output_bytes:
                del buffer[self.output_bytes :]
                return False
        return True

    def close(self) -> None:
        for key in list(self.selector.get_map().values()):
            self.selector.unregister(key.fileobj)
        self.selector.close()


def _watch(
    process: subprocess.Popen[bytes], limits: SandboxLimits, netns: str | None
) -> tuple[Outcome | None, _Reader]:
    """Reads the program's output until its pipes close, killing everything on timeout, overflow or its exit.

    Returns:
        ("timeout" | "output_too_large" | None when it ended by itself, the reader with what it read).
    """
    reader = _Reader(process, limits.output_bytes)
    deadline = time.monotonic() + limits.wall_s
    stopped: Outcome | None = None
    swept = False
    killed: set[int] = set()
    while reader.open():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stopped = "timeout"
            break
        if not reader.read(min(remaining, 0.1)):
            stopped = "output_too_large"
            break
        if not swept and process.poll() is not None:
            # Its children may hold the pipes open: they go with it.
            killed |= _sweep(process.pid, netns)
            swept = True
    killed |= _sweep(process.pid, netns)
    process.wait()
    reader.close()
    _await_reaped(killed - {process.pid})
    return stopped, reader


def _classify(stopped: Outcome | None, exit_code: int, stdout: str, stderr: str) -> Outcome:
    """The outcome of a program that was not stopped by the sandbox (or was: `stopped` wins)."""
    if stopped is not None:
        return stopped
    if exit_code == -signal.SIGXCPU:
        return "timeout"
    if exit_code < 0:
        return "killed"
    if exit_code != 0:
        last = stderr.strip().rsplit("\n", 1)[-1]
        return "memory" if last.startswith("MemoryError") else "error"
    return "ok" if stdout.strip() else "no_output"


def run_program(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Runs a Python program in the sandbox.

    Args:
        code: the program's source.
        limits: what it may use.

    Returns:
        How it ended, with what it printed. Nothing the program does raises.

    Raises:
        BadInputError: `code` is not a string.
        SandboxError: the sandbox could not start any interpreter (the first time in this process; later
            failures to start are an "error" outcome with the reason in `stderr_tail`).
    """
    if not isinstance(code, str):
        raise BadInputError(f"a sandboxed program is source text, got {type(code).__name__}")
    source = code.encode("utf-8", errors="surrogateescape")
    workdir = tempfile.mkdtemp(prefix="kvgraft-sandbox-")
    start = time.monotonic()
    try:
        process, isolation = _start(source, workdir, limits)
        netns = _netns(process.pid) if isolation != "none" else None
        stopped, reader = _watch(process, limits, netns)
    except _StartFailed as exc:
        return _not_started(str(exc), time.monotonic() - start)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    wall_s = time.monotonic() - start
    stdout = reader.stdout.decode("utf-8", errors="replace")
    stderr = reader.stderr.decode("utf-8", errors="replace")
    outcome = _classify(stopped, process.returncode, stdout, stderr)
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    return SandboxResult(
        outcome=outcome,
        answer=lines[-1] if outcome == "ok" else None,
        stdout=stdout,
        stderr_tail=stderr,
        exit_code=None if stopped is not None else process.returncode,
        wall_s=wall_s,
        isolation=isolation,
        network_isolated=isolation != "none",
        filesystem_isolated=isolation == "root",
    )


def _not_started(reason: str, wall_s: float) -> SandboxResult:
    """The result of a program the sandbox could not start this time: an "error" with the reason as its stderr."""
    return SandboxResult(
        outcome="error",
        answer=None,
        stdout="",
        stderr_tail=f"the sandbox could not start the program: {reason}",
        exit_code=None,
        wall_s=wall_s,
        isolation="none",
        network_isolated=False,
        filesystem_isolated=False,
    )
