"""The alerts, proven on data: `promtool test rules` runs deploy/prometheus/tests/, where every
alert fires on the series that should raise it and stays quiet on those that should not."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.deploy.manifests import DEPLOY
from tests.deploy.promql import RULE_FILE, promtool, rule_groups

RULE_TESTS = DEPLOY / "prometheus" / "tests"
RULES_NAME = "graft-rules.yaml"     # what the tests load: the PrometheusRule's spec as a rule file


def unit_test_files() -> list[Path]:
    files = sorted(RULE_TESTS.glob("*.yaml"))
    assert files, f"no rule unit tests in {RULE_TESTS}"
    return files


def run_unit_tests(workdir: Path, files: list[Path]) -> subprocess.CompletedProcess:
    """`promtool test rules` on `files`, beside the shipped rules written out as a plain rule file."""
    spec = yaml.safe_load(RULE_FILE.read_text(encoding="utf-8"))["spec"]
    (workdir / RULES_NAME).write_text(yaml.safe_dump(spec), encoding="utf-8")
    for path in files:
        if path.parent != workdir:
            shutil.copy(path, workdir / path.name)
    return subprocess.run([promtool(), "test", "rules", *(p.name for p in files)], cwd=workdir,
                          capture_output=True, text=True, timeout=120)


def test_every_alert_is_tested_firing_and_quiet():
    alerts = {r["alert"] for g in rule_groups() for r in g["rules"] if "alert" in r}
    fires, quiet = set(), set()
    for path in unit_test_files():
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        assert doc["rule_files"] == [RULES_NAME], path.name
        for test in doc["tests"]:
            for case in test.get("alert_rule_test", []):
                (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
    assert (fires | quiet) <= alerts, f"tests of alerts that do not exist: {(fires | quiet) - alerts}"
    assert not alerts - fires, f"never shown firing: {sorted(alerts - fires)}"
    assert not alerts - quiet, f"never shown quiet: {sorted(alerts - quiet)}"


def test_alert_unit_tests_pass(tmp_path):
    done = run_unit_tests(tmp_path, unit_test_files())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_a_wrong_expectation_fails_the_unit_tests(tmp_path):
    # the harness must see a failing expectation, or a passing run proves nothing
    wrong = tmp_path / "wrong.test.yaml"
    wrong.write_text(yaml.safe_dump({"rule_files": [RULES_NAME], "evaluation_interval": "30s", "tests": [{
        "interval": "1m",
        "input_series": [{"series": 'graft_kv_cache_usage_ratio{namespace="llm", pod="e-0"}', "values": "0.5x30"}],
        "alert_rule_test": [{"eval_time": "20m", "alertname": "GraftKVCacheNearlyFull", "exp_alerts": [
            {"exp_labels": {"severity": "warning", "namespace": "llm", "pod": "e-0"}}]}],
    }]}))
    done = run_unit_tests(tmp_path, [wrong])
    assert done.returncode != 0 and "GraftKVCacheNearlyFull" in done.stdout + done.stderr
