"""The code rung's sandbox: real programs in real processes, each ending the way its outcome says."""

from __future__ import annotations

import os
import signal
import socket
import uuid
from pathlib import Path

import pytest

from kvgraft.core.errors import BadInputError
from kvgraft.flywheel.sandbox import SandboxLimits, SandboxResult, extract_program, run_program

# Short limits keep the slow cases (loops, bombs) to a second or two each.
FAST = SandboxLimits(cpu_s=1, wall_s=5)


def _alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rsplit(b")", 1)[1].split()[0] != b"Z"


def _group_members(pgid: int) -> list[int]:
    """Live processes in a process group, found by scanning /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def _first_line_int(result: SandboxResult) -> int:
    return int(result.stdout.splitlines()[0])


def test_printing_a_number_is_ok_with_that_answer() -> None:
    result = run_program("x = 6 * 7\nprint('thinking')\nprint(x)\n")
    assert result.outcome == "ok"
    assert result.answer == "42"
    assert result.stdout == "thinking\n42\n"
    assert result.exit_code == 0
    assert result.to_json()["answer"] == "42"


def test_a_syntax_error_is_an_error() -> None:
    result = run_program("print(")
    assert result.outcome == "error"
    assert result.exit_code == 1
    assert result.answer is None
    assert "SyntaxError: '(' was never closed" in result.stderr_tail


def test_printing_nothing_is_no_output() -> None:
    result = run_program("x = 1\n")
    assert (result.outcome, result.answer, result.stdout) == ("no_output", None, "")


def test_the_environment_is_empty_and_stdin_closed() -> None:
    result = run_program("import os, sys\nprint(sorted(os.environ))\nprint(repr(sys.stdin.read()))\n")
    assert result.outcome == "ok"
    assert result.stdout.splitlines() == ["['LC_ALL', 'PATH']", "''"]


def test_an_endless_loop_times_out_and_its_group_is_gone() -> None:
    result = run_program("import os\nprint(os.getpgid(0), flush=True)\nwhile True: pass\n", FAST)
    assert result.outcome == "timeout"
    assert result.exit_code == -signal.SIGXCPU
    assert result.answer is None
    assert _group_members(_first_line_int(result)) == []


def test_sleeping_past_the_wall_clock_times_out() -> None:
    result = run_program("import time\nprint('started', flush=True)\ntime.sleep(60)\n", SandboxLimits(wall_s=1))
    assert result.outcome == "timeout"
    assert result.exit_code is None
    assert result.stdout == "started\n"


def test_a_fork_bomb_ends_and_leaves_nothing_running() -> None:
    result = run_program("import os\nprint(os.getpgid(0), flush=True)\nwhile True: os.fork()\n", FAST)
    assert result.outcome in {"timeout", "error", "killed"}
    assert _group_members(_first_line_int(result)) == []
    # The machine is fine: the next program runs as usual.
    assert run_program("print(42)").answer == "42"


def test_a_child_that_leaves_the_session_is_killed_too() -> None:
    code = (
        "import os, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\n"
        "print(pid)\n"
    )
    result = run_program(code, FAST)
    if not result.network_isolated:
        pytest.skip("without its own network namespace, a process that calls setsid() escapes the sweep")
    assert result.outcome == "ok", result
    assert not _alive(int(result.answer or "0"))


def test_a_program_ended_by_a_signal_is_killed() -> None:
    result = run_program("import os, signal\nprint(1, flush=True)\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    assert (result.outcome, result.exit_code, result.answer) == ("killed", -signal.SIGSEGV, None)


def test_unbounded_allocation_is_memory() -> None:
    result = run_program('x = []\nwhile True: x.append(b"x"*10**7)\n', SandboxLimits(memory_bytes=256 * 1024 * 1024))
    assert result.outcome == "memory"
    assert result.stderr_tail.rstrip().endswith("MemoryError")


def test_huge_output_is_output_too_large() -> None:
    result = run_program('while True: print("x" * 1000)\n', SandboxLimits(output_bytes=10_000))
    assert result.outcome == "output_too_large"
    assert result.stdout == ("x" * 1000 + "\n") * 9 + "x" * 991
    assert result.answer is None


def test_a_file_over_the_size_limit_is_an_error() -> None:
    code = 'with open("big", "wb") as f:\n    f.write(b"x" * 5000)\nprint("wrote")\n'
    result = run_program(code, SandboxLimits(file_bytes=1000))
    assert result.outcome == "error"
    assert result.stderr_tail.endswith("OSError: [Errno 27] File too large\n")


def test_writing_in_its_own_directory_works() -> None:
    result = run_program('open("notes.txt", "w").write("7")\nprint(open("notes.txt").read())\n')
    assert (result.outcome, result.answer) == ("ok", "7")


def test_writing_outside_its_directory_creates_nothing(tmp_path: Path) -> None:
    escape = Path(f"/tmp/escape-{uuid.uuid4().hex}")
    inside_test = tmp_path / "escape.txt"
    code = "".join(
        f"try:\n    open({str(path)!r}, 'w').write('x')\nexcept OSError as e:\n    print(e)\n"
        for path in (escape, inside_test)
    )
    result = run_program(code)
    if not result.filesystem_isolated:
        pytest.skip("not root: the program runs as the caller's user and can write where that user can")
    assert not escape.exists()
    assert not inside_test.exists()
    # /tmp (writable by anyone outside) is read-only for it; the test's directory is also closed to `nobody`.
    assert result.stdout.splitlines() == [
        f"[Errno 30] Read-only file system: '{escape}'",
        f"[Errno 13] Permission denied: '{inside_test}'",
    ]


def test_no_connection_leaves_the_sandbox() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        result = run_program(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')\n"
        )
        if not result.network_isolated:
            pytest.skip("this OS gives the program no network namespace of its own")
        assert result.outcome == "error"
        assert "Network is unreachable" in result.stderr_tail
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_bad_limits_and_code_are_bad_input() -> None:
    with pytest.raises(BadInputError, match=r"^sandbox limit cpu_s must be positive, got 0$"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(BadInputError, match=r"^a sandboxed program is source text, got bytes$"):
        run_program(b"print(1)")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "program"),
    [
        ("Here:\n```python\nprint(1)\n```\nand\n```python\nprint(2)\n```\n", "print(2)\n"),
        ("```\nprint(3)\n```\n```text\nnot code\n```", "print(3)\n"),
        ("```py\nprint(4)\n```\n```\nprint(5)\n```", "print(4)\n"),
        ("```Python3\nprint(6)\n```", "print(6)\n"),
        ("no code at all", None),
        ("```python\n   \n```", None),
        ("```python\nprint(7)\n", None),
        ("```text\nprint(8)\n```", None),
    ],
)
def test_extract_program(text: str, program: str | None) -> None:
    assert extract_program(text) == program
