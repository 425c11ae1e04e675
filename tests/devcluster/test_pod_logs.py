"""A container's log as `kubectl logs` shows it: only the current instance, tailLines and limitBytes honoured."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from graft.devcluster.podlogs import read_container_log


def _run_into(log: Path, code: str, restarts: int) -> None:
    # The same layout the pod runner writes: a start line, then the process's stdout and stderr.
    with open(log, "ab") as out:
        out.write(f"--- start 2026-01-01T00:00:00Z restarts={restarts} env GRAFT_PATCHES=\n".encode())
        out.flush()
        subprocess.run([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, check=False)


def test_log_shows_only_the_current_instance(tmp_path: Path) -> None:
    log = tmp_path / "job-abc.log"
    _run_into(log, "print('first run'); raise SystemExit(1)", 0)
    _run_into(log, "import sys; print('line 1'); print('{\"score\": 0.9}'); print('oops', file=sys.stderr)", 1)
    assert read_container_log(log) == b'line 1\n{"score": 0.9}\noops\n'


def test_tail_lines_then_limit_bytes(tmp_path: Path) -> None:
    log = tmp_path / "p.log"
    _run_into(log, "for i in range(5): print(f'row {i}')", 0)
    assert read_container_log(log, tail_lines=2) == b"row 3\nrow 4\n"
    assert read_container_log(log, tail_lines=0) == b""
    assert read_container_log(log, tail_lines=2, limit_bytes=4) == b"row "


def test_missing_log_is_empty_and_bad_parameters_are_named(tmp_path: Path) -> None:
    assert read_container_log(tmp_path / "never-started.log") == b""
    with pytest.raises(ValueError, match="tailLines"):
        read_container_log(tmp_path / "x.log", tail_lines=-1)
    with pytest.raises(ValueError, match="limitBytes"):
        read_container_log(tmp_path / "x.log", limit_bytes=0)


async def test_the_emulator_serves_a_pods_log_as_text(tmp_path: Path) -> None:
    import httpx

    from graft.devcluster.apiserver import ApiServer

    _run_into(tmp_path / "worker.log", "print('hello'); print('{\"score\": 0.9}')", 0)
    async with ApiServer(pod_logs_dir=tmp_path) as server, httpx.AsyncClient(base_url=server.url) as http:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "worker", "namespace": "default"},
               "spec": {"containers": [{"name": "main", "image": "python"}]}}
        assert (await http.post("/api/v1/namespaces/default/pods", json=pod)).status_code == 201
        full = await http.get("/api/v1/namespaces/default/pods/worker/log")
        assert full.status_code == 200 and full.text == 'hello\n{"score": 0.9}\n'
        assert full.headers["content-type"].startswith("text/plain")
        tail = await http.get("/api/v1/namespaces/default/pods/worker/log", params={"tailLines": "1"})
        assert tail.text == '{"score": 0.9}\n'
        bad = await http.get("/api/v1/namespaces/default/pods/worker/log", params={"tailLines": "-1"})
        assert bad.status_code == 400 and "tailLines" in bad.json()["message"]
        missing = await http.get("/api/v1/namespaces/default/pods/nobody/log")
        assert missing.status_code == 404
