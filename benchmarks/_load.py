"""CPU load for benchmarks that measure under it: busy processes that spin until stopped."""

from __future__ import annotations

import os
import subprocess
import sys


class BusyLoad:
    """`count` processes spinning on the CPU until stopped."""

    def __init__(self, count: int) -> None:
        # Each loop also ends by itself when this process dies, however it dies.
        spin = f"import os\nwhile os.getppid() == {os.getpid()}: pass"
        self.processes = [
            subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.DEVNULL) for _ in range(count)
        ]

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.wait()
