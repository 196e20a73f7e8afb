"""The GPU as the benchmark sees it through nvidia-smi: what it is, and the device memory a system used."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from specter_gguf.sizes import MiB


def gpu_info() -> dict[str, Any]:
    """Name, driver and memory of the GPU nvidia-smi sees first; on a machine without one, the CPU."""
    info: dict[str, Any] = {"gpu": None}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader",
                                  "-i", gpu_index()], capture_output=True, text=True, timeout=20).stdout.strip()
            name, driver, total = [x.strip() for x in out.splitlines()[0].split(",")]
            info.update(gpu=name, driver=driver, gpu_memory=total)
        except Exception as e:  # noqa: BLE001
            info["gpu_error"] = str(e)
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info["cpu"] = f"{cpu} ({os.cpu_count()} threads)"
    return info


def gpu_index() -> str:
    v = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return v if v.isdigit() else "0"


class GpuMemoryMonitor:
    """Peak device memory in use (nvidia-smi, every 100 ms) above the level just before `start`.
    Without nvidia-smi every figure is None."""

    def __init__(self, interval_ms: int = 100, enabled: bool = True) -> None:
        self.smi = shutil.which("nvidia-smi") if enabled else None
        self.interval_ms = interval_ms
        self.baseline_mib: float | None = None
        self.peak_mib: float | None = None
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def _query(self) -> float | None:
        if not self.smi:
            return None
        try:
            out = subprocess.run([self.smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                  "-i", gpu_index()], capture_output=True, text=True, timeout=20).stdout
            return float(out.strip().splitlines()[0])
        except Exception:  # noqa: BLE001
            return None

    def start(self) -> "GpuMemoryMonitor":
        if not self.smi:
            return self
        # memory of a process that just exited can take a moment to be released
        prev = self._query()
        for _ in range(10):
            time.sleep(0.3)
            cur = self._query()
            if cur is None or prev is None or abs(cur - prev) < 16:
                break
            prev = cur
        self.baseline_mib = self._query()
        self.peak_mib = self.baseline_mib
        self._proc = subprocess.Popen([self.smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                       "-i", gpu_index(), "-lms", str(self.interval_ms)],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            with contextlib.suppress(ValueError):
                v = float(line.strip())
                self.peak_mib = v if self.peak_mib is None else max(self.peak_mib, v)

    def sample(self) -> None:
        """One extra reading (e.g. right before stopping the system)."""
        v = self._query()
        if v is not None:
            self.peak_mib = v if self.peak_mib is None else max(self.peak_mib, v)

    def stop(self) -> float | None:
        """Peak bytes above the baseline."""
        if self._proc is not None:
            self._proc.terminate()
            with contextlib.suppress(Exception):
                self._proc.wait(timeout=5)
            if self._thread is not None:
                self._thread.join(timeout=2)
        if self.peak_mib is None or self.baseline_mib is None:
            return None
        return max(0.0, self.peak_mib - self.baseline_mib) * MiB
