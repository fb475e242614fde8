"""ServerProcess: a `python -m vllm_chunkattn.serve` server on loopback for demos, tests and
benchmarks, in its own process group and always stopped; plus what those read from its log (the
TPP decode kernel in use, the engine's modes, the first real error)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import deque
from pathlib import Path
from threading import Thread


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# The line plugin/backend.py logs once per process that runs attention (each TP rank): which
# TPP decode kernel serves CUSTOM (tests and benchmarks assert it was the native one).
KERNEL_IN_USE = re.compile(r"ChunkAttention backend \(CUSTOM\) in use: TPP decode kernel=([\w-]+)")


def engine_modes(log: str) -> dict[str, str]:
    """The model runner and async scheduling a server ran with, from its log (vLLM logs the V2
    runner; the tree scheduler's start-up line says async scheduling on / off)."""
    asynchronous = re.search(r"async scheduling (on|off)", log)
    return {"model_runner": "V2" if "Using V2 Model Runner" in log else "V1",
            "async_scheduling": asynchronous.group(1) if asynchronous else "unknown"}


class ServerError(RuntimeError):
    pass


# "ValueError: ..." as it appears in vLLM's logs; the wrappers vLLM adds around the real cause
# ("Engine core initialization failed", "Worker failed with error ...") are skipped. A ValueError
# raised while vLLM's (pydantic) config is built reads "ValidationError: 1 validation error for
# VllmConfig", then "  Value error, <the message> [type=value_error, ...]" on the next line.
_ERROR_LINE = re.compile(r"\b([A-Za-z]+(?:Error|Exception)): (.+)$")
_CONFIG_VALUE_ERROR = re.compile(r"^\s*Value error, (.+?)(?: \[type=value_error\b.*)?$")
_WRAPPERS = ("Engine core initialization failed", "Worker failed with error",
             "See root cause above", "validation error for")


class ServerProcess:
    """A vLLM server in a child process group; a context manager that always stops it.

    The server's output is kept (last `keep_lines` lines) so a failure can show why."""

    def __init__(self, model: str, args: list[str], port: int | None = None,
                 env: dict | None = None, log_path: str | Path | None = None,
                 keep_lines: int = 200):
        self.port = port or free_port()
        if port_is_busy(self.port):
            raise ServerError(f"port {self.port} is already in use; pick another with --port")
        self.cmd = [sys.executable, "-m", "vllm_chunkattn.serve", model, "--host", "127.0.0.1",
                    "--port", str(self.port)] + args
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        self.log_path = Path(log_path) if log_path else None
        self.lines: deque[str] = deque(maxlen=keep_lines)
        self.errors: deque[str] = deque(maxlen=20)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 600) -> "ServerProcess":
        if self.proc is not None and self.proc.poll() is None:
            # A second start would orphan the running server (its GPU or KV memory, its port):
            # `with ServerProcess(...)` has already started it.
            raise ServerError(f"the server on {self.url} is already running; stop() it first")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                time.sleep(0.5)               # let the drain thread read the last lines
                raise ServerError(f"server exited with code {self.proc.returncode} during "
                                  f"start-up: {self.root_cause()}\nlast lines:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(1)
        self.stop()
        raise ServerError(f"server not ready after {timeout_s:.0f}s; last lines:\n{self.tail()}")

    def _drain(self) -> None:
        log = open(self.log_path, "w") if self.log_path else None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = _ERROR_LINE.search(line)
            if m and not any(w in line for w in _WRAPPERS + (" WARNING ", " INFO ")):
                self.errors.append(f"{m.group(1)}: {m.group(2).strip()}")
            elif m := _CONFIG_VALUE_ERROR.match(line):
                self.errors.append(f"ValueError: {m.group(1).strip()}")
            if log:
                log.write(line)
                log.flush()
        if log:
            log.close()

    def root_cause(self) -> str:
        """The first real error the server logged (not vLLM's wrappers around it)."""
        return self.errors[0] if self.errors else "(no error line found; see the log)"

    def tail(self, n: int = 40) -> str:
        return "\n".join(list(self.lines)[-n:])

    def stop(self, timeout_s: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:                                  # the whole group: API server, engine, workers
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(timeout_s)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def __enter__(self) -> "ServerProcess":
        try:
            return self.start()
        except BaseException:             # Ctrl-C or a failure during start-up: no orphan
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
