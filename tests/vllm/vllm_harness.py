"""Start and stop real vLLM OpenAI API servers (CPU build) for tests: loopback only, bounded waits.

Servers run as ``python -m vllm.entrypoints.openai.api_server`` in their own process group (so
teardown ends the engine core and worker processes too), log to a file (a pipe could fill and
block the server), and are killed if they do not stop within a grace period.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from latency_specialized.testing.matrix import free_port

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
START_TIMEOUT_S = float(os.environ.get("LS_TEST_VLLM_START_TIMEOUT", "420"))
"""Bound of a server start (about 75-150 s on 2 shared cores)."""
REQUEST_TIMEOUT_S = 120.0

# Small and fast on 2 cores: fp32 (the reference ops accumulate in fp32 too), eager (no compile),
# an explicit small KV cache instead of a fraction of host RAM.
BASE_ARGS = ("--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8", "--enforce-eager",
             "--kv-cache-memory-bytes", str(64 * 2**20), "--served-model-name", "tiny", "--seed", "0")


def base_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LATENCY_SPECIALIZED_DECODE_BACKEND", None)  # tests choose the backend explicitly
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def run_cli(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the API server module with ``args`` to completion (for --help and bad arguments)."""
    return subprocess.run([sys.executable, "-m", SERVER_MODULE, *args], capture_output=True, text=True,
                          timeout=timeout, env=env or base_env(), stdin=subprocess.DEVNULL)


@dataclass
class Server:
    """One API server process."""

    name: str
    model: Path
    log_path: Path
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=base_env)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Server":
        cmd = [sys.executable, "-m", SERVER_MODULE, "--model", str(self.model), "--host", "127.0.0.1",
               "--port", str(self.port), *BASE_ARGS, *self.extra_args]
        self._log = open(self.log_path, "w")
        self._log.write("$ " + " ".join(cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env, start_new_session=True)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until /health answers 200; raises with the log tail if the process dies or time runs out."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} server not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def wait_exit(self, timeout: float = START_TIMEOUT_S) -> int:
        """Until the process exits (for servers expected to fail at start); returns the exit code."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{self.name} server still running after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after ``grace_s``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # the engine core / workers may outlive the API process: end the whole group we started
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self._log.close()

    # ------------------------------------------------------------------ requests
    def post(self, path: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        req = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{self.name} {path} -> HTTP {e.code}: {e.read().decode(errors='replace')}") from e

    def stream(self, path: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> list[dict[str, Any]]:
        """Server-sent events of a streaming request, parsed (without the final [DONE])."""
        req = urllib.request.Request(f"{self.url}{path}", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        events = []
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                events.append(json.loads(data))
        return events


def read_trace(path: Path, *, min_fast: int = 1, timeout: float = 10.0) -> dict[str, Any]:
    """The worker's trace JSON once it shows ``min_fast`` fast steps (it is flushed every 0.5 s)."""
    deadline = time.monotonic() + timeout
    data: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if path.exists():
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError:  # never expected (atomic rename); retry once more anyway
                data = {}
            if data.get("summary", {}).get("fast_steps", 0) >= min_fast:
                return data
        time.sleep(0.2)
    return data
