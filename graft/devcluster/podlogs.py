"""What `kubectl logs` shows of a dev-cluster container: its printed output, read from the runner's log file.

The pod runner appends each start of a container to one file, headed by a `--- start` line; the kubelet
serves only the current instance's output, so the reader begins after the last such line.
`tailLines` and `limitBytes` are applied as the kubelet does: the last N lines first, then the first
limitBytes bytes of those.
"""
from __future__ import annotations

from pathlib import Path

START_MARK = b"--- start "


def read_container_log(path: Path, *, tail_lines: int | None = None, limit_bytes: int | None = None) -> bytes:
    """Return the current container instance's output from the runner's log file at `path`.

    Raises ValueError naming the parameter when tail_lines or limit_bytes is negative (limitBytes must
    also be positive), as kube-apiserver refuses them.
    """
    if tail_lines is not None and tail_lines < 0:
        raise ValueError(f"tailLines: must be greater than or equal to 0, got {tail_lines}")
    if limit_bytes is not None and limit_bytes < 1:
        raise ValueError(f"limitBytes: must be greater than 0, got {limit_bytes}")
    data = path.read_bytes() if path.exists() else b""
    lines = data.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith(START_MARK)]
    if starts:
        lines = lines[starts[-1] + 1:]
    if tail_lines is not None:
        lines = lines[len(lines) - tail_lines:] if tail_lines else []
    out = b"".join(lines)
    return out[:limit_bytes] if limit_bytes is not None else out
