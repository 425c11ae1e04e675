"""The job metric provider: each step's Job made from the check, run by the dev cluster's real Job
controller and pod runner (`python -c` containers), and its number read: the exit code, or a line of
JSON in its log. Who may run Jobs is the administrator's; a job check the API server would refuse is
refused by name; a Job that still runs holds the step whatever the check's role."""
from __future__ import annotations

import asyncio
import time

import pytest

from graft.devcluster.apiserver import ApiServer
from graft.devcluster.podrunner import PodRunner
from graft.operator.jobs import JobProvider, job_name, last_json_line
from graft.operator.kube import Kube, job_path, pods_path
from graft.operator.runtime import Runtime
from graft.operator.settings import OperatorSettings
from graft.rollout import analysis
from graft.rollout.analysis import plan_run
from graft.rollout.observation import Measurement
from graft.rollout.spec import SpecError, parse_spec
from graft.rollout.status import RolloutStatus

NS = "default"
BASE = {"selector": {"matchLabels": {"app": "e"}}, "patch": {"name": "kv-align", "version": "3.2.1"}}
OWNER = {"name": "kv-align-rollout", "uid": "6f1c2a90-0000-4000-8000-000000000001"}


def job_check(code: str, role: str = "gates", json_path: str | None = None, timeout: str = "30s",
              **limits) -> dict:
    job = {"spec": {"template": {"spec": {"containers": [{"name": "eval", "command": ["python", "-c", code]}]}}},
           "timeout": timeout, **({"jsonPath": json_path} if json_path else {})}
    return {**BASE, "analysis": {role: [{"name": "accuracy-drop", **(limits or {"max": 0.1}), "job": job}]}}


def series_of(manifest: dict, status: RolloutStatus | None = None):
    status = status or RolloutStatus(canary_revision="kv-align@3.2.1", stable_revision="base")
    ((check, (series,)),) = plan_run(parse_spec(manifest), status, NS, 100.0)
    return check, series


@pytest.fixture
async def server(tmp_path):
    async with ApiServer() as s:
        s.pod_logs_dir = tmp_path / "pods"      # kubectl logs reads the pod runner's files
        yield s
        assert not s.errors, s.errors


@pytest.fixture
async def kube(server):
    async with Kube(server.url) as k:
        yield k


@pytest.fixture
async def runner(server, tmp_path):
    async with PodRunner(server.url, NS, tmp_path / "pods", poll=0.2) as r:
        yield r


async def measure_until_done(provider: JobProvider, kube: Kube, check, series, *, step: int = 0,
                             started: float = 1000.0, timeout: float = 40.0) -> tuple[Measurement, list[str]]:
    """Ask as the rollout does, run after run, until the Job's number is in; the pending sentences seen."""
    pending: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = await provider.measure(kube, check.key, series.job, namespace=NS, owner=OWNER, check=check.name,
                                   step=step, step_started=started)
        if not m.pending:
            return m, pending
        pending.append(m.pending)
        await asyncio.sleep(0.2)
    raise AssertionError(f"the job never ended: {pending[-3:]}")


@pytest.mark.parametrize("code,json_path,value,error", [
    ("print('scoring'); raise SystemExit(0)", None, 0.0, None),
    ("raise SystemExit(3)", None, 3.0, None),
    ("print('progress 10/10'); print('{\"accuracy\": 0.4, \"difference\": 0.25}')", "$.difference", 0.25, None),
    ("print('{\"difference\": 0.5}'); print('{\"difference\": 0.125}'); print('done')", "$.difference", 0.125, None),
    ("print('{\"per_task\": {\"snarks\": [1, true]}}')", "$.per_task.snarks[1]", 1.0, None),
    ("print('{\"n\": 10, \"difference\": null}')", "$.difference", None, None),
    ("print('{\"difference\": \"high\"}')", "$.difference", None, "not a number"),
    ("print('no endpoint'); raise SystemExit(2)", "$.difference", None, "BackoffLimitExceeded, exit code 2): no endpoint"),
    ("print('all done')", "$.difference", None, "printed no line that is a JSON object"),
])
async def test_the_number_is_the_exit_code_or_the_last_json_line(kube, runner, code, json_path, value, error):
    check, series = series_of(job_check(code, json_path=json_path))
    m, pending = await measure_until_done(JobProvider(), kube, check, series)
    assert pending and pending[0].startswith("job ") and pending[0].endswith(" started")
    assert m.error is None if error is None else error in m.error, m.error
    if error is None:
        assert m.get("value") == value and m.final


async def test_the_job_is_the_checks_with_its_defaults_placeholders_filled_and_owned_by_the_rollout(kube, runner):
    code = "import sys; print('{\"canary\": \"' + sys.argv[1] + '\", \"d\": 0}')"
    manifest = job_check(code, json_path="$.d", timeout="45s")
    container = manifest["analysis"]["gates"][0]["job"]["spec"]["template"]["spec"]["containers"][0]
    container["command"].append("{{canaryRevision}} in {{namespace}}")
    manifest["analysis"]["gates"][0]["job"]["metadata"] = {"labels": {"team": "llm"}}
    check, series = series_of(manifest)
    m, _ = await measure_until_done(JobProvider(), kube, check, series)
    assert m.get("value") == 0.0
    (job,) = await kube.list(job_path(NS))
    meta, spec = job["metadata"], job["spec"]
    assert meta["name"] == job_name(OWNER["name"], "accuracy-drop", f"{OWNER['uid']}/gate/accuracy-drop/0/1000")
    assert meta["labels"] == {"team": "llm", "graft.dev/rollout-uid": OWNER["uid"], "graft.dev/check": "accuracy-drop"}
    assert meta["annotations"] == {"graft.dev/rollout": OWNER["name"], "graft.dev/step": "0"}
    assert meta["ownerReferences"] == [{"apiVersion": "graft.dev/v1alpha1", "kind": "PatchRollout", **OWNER}]
    assert (spec["backoffLimit"], spec["activeDeadlineSeconds"], spec["ttlSecondsAfterFinished"]) == (0, 45, 3600)
    assert spec["template"]["spec"]["containers"][0]["command"][-1] == f"kv-align@3.2.1 in {NS}"
    (pod,) = await kube.list(pods_path(NS), label_selector=f"job-name={meta['name']}")
    assert pod["metadata"]["labels"]["graft.dev/rollout-uid"] == OWNER["uid"]


async def test_one_job_per_step_read_once(kube, runner):
    check, series = series_of(job_check("print('{\"d\": 0.5}')", json_path="$.d"))
    provider = JobProvider()
    first, _ = await measure_until_done(provider, kube, check, series, step=0)
    (job,) = await kube.list(job_path(NS))
    for pod in await kube.list(pods_path(NS), label_selector=f"job-name={job['metadata']['name']}"):
        await kube.delete(pods_path(NS, pod["metadata"]["name"]))
    # later runs of the same step: the same Job, its number remembered (its pod and log are gone)
    again, pending = await measure_until_done(provider, kube, check, series, step=0)
    assert (first.get("value"), again.get("value"), pending) == (0.5, 0.5, [])
    assert len(await kube.list(job_path(NS))) == 1
    # the next step, or the same step begun again (a retried rollout): a Job of its own
    await measure_until_done(provider, kube, check, series, step=1)
    await measure_until_done(provider, kube, check, series, step=1, started=2000.0)
    assert len({j["metadata"]["name"] for j in await kube.list(job_path(NS))}) == 3


async def test_a_job_past_its_timeout_is_an_error_naming_the_deadline(kube, runner):
    check, series = series_of(job_check("import time; time.sleep(60)", json_path="$.d", timeout="1s"))
    m, pending = await measure_until_done(JobProvider(), kube, check, series)
    assert "DeadlineExceeded" in m.error and not m.outage, m.error
    assert any("running for" in p for p in pending), pending


async def test_a_job_the_api_server_refuses_is_an_error_and_nothing_runs(server):
    check, series = series_of(job_check("print(1)"))
    forbidden = Kube(server.url + "/no-such-prefix")
    try:
        m = await JobProvider().measure(forbidden, check.key, series.job, namespace=NS, owner=OWNER,
                                        check=check.name, step=0, step_started=1.0)
    finally:
        await forbidden.aclose()
    assert m.error and m.error.startswith("job ") and not m.pending


def test_job_checks_and_their_service_accounts_are_the_administrators():
    checks = parse_spec(job_check("print(1)")).analysis.checks
    refused = Runtime(OperatorSettings()).job_refusal(checks)
    assert refused.reason == "JobNotAllowed" and refused.permanent and "GRAFT_JOB_CHECKS" in refused.message
    assert Runtime(OperatorSettings(job_checks=True)).job_refusal(checks) is None
    manifest = job_check("print(1)")
    manifest["analysis"]["gates"][0]["job"]["spec"]["template"]["spec"]["serviceAccountName"] = "cluster-admin-sa"
    other = parse_spec(manifest).analysis.checks
    refused = Runtime(OperatorSettings(job_checks=True)).job_refusal(other)
    assert refused.reason == "JobNotAllowed" and "'cluster-admin-sa'" in refused.message
    env = OperatorSettings.from_env({"GRAFT_JOB_CHECKS": "true", "GRAFT_JOB_SERVICE_ACCOUNTS": "default,evals",
                                     "GRAFT_ADMIN_CA_FILE": "/ca.pem"})
    assert (env.job_checks, env.job_service_accounts) == (True, ["default", "evals"])
    allowed = OperatorSettings(job_checks=True, job_service_accounts=["default", "evals"])
    manifest["analysis"]["gates"][0]["job"]["spec"]["template"]["spec"]["serviceAccountName"] = "evals"
    assert Runtime(allowed).job_refusal(parse_spec(manifest).analysis.checks) is None


def _with_job(**job) -> dict:
    return {**BASE, "analysis": {"gates": [{"name": "q", "max": 1, "job": job}]}}


POD = {"template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}}


@pytest.mark.parametrize("manifest,needle", [
    (_with_job(spec={"template": {"spec": {}}}), "job.spec.template.spec.containers"),
    (_with_job(spec={"template": {"spec": {"containers": [{"name": "c", "args": ["{{canary}}"]}]}}}),
     "unknown template variable"),
    (_with_job(spec={"template": {"spec": {"containers": [{"name": "c", "args": ["{{args.model}}"]}]}}}),
     "args.model"),
    (_with_job(spec=POD, timeout="2h"), "job.timeout"),
    (_with_job(spec=POD, jsonPath="$..d"), "job.jsonPath"),
    ({**BASE, "analysis": {"gates": [{"name": "q", "max": 1, "query": 'up{namespace="{{namespace}}"}',
                                      "job": {"spec": POD}}]}}, "a check has one source"),
])
def test_a_job_check_the_api_server_would_refuse_is_refused_by_name(manifest, needle):
    with pytest.raises(SpecError, match=needle.replace(".", r"\.").replace("$", r"\$")):
        parse_spec(manifest)


def test_the_last_json_object_line_is_the_answer():
    assert last_json_line('{"a": 1}\nnot json {\n{"a": 2}\n[1, 2]\n{broken\n') == {"a": 2}
    assert last_json_line("nothing here\n") is None


def test_a_running_job_holds_the_step_and_a_final_breach_of_a_gate_rolls_back():
    for role in ("breakers", "gates"):
        spec = parse_spec(job_check("print(1)", role=role, json_path="$.d"))
        (check,) = spec.analysis.checks
        verdict, (result,) = analysis.run(spec.analysis, [Measurement(check.key, {"value": None},
                                                                      pending="job x running for 3s")],
                                          [], stable_pods=True)
        assert (verdict, result.verdict, result.pending) == ("Inconclusive", "Inconclusive", True), role
        assert analysis.holding([result]) == [result] and "job x running" in result.message
        verdict, (result,) = analysis.run(spec.analysis, [Measurement(check.key, {"value": 0.5}, final=True)], [],
                                          stable_pods=True)
        assert verdict == "Failed" and result.verdict == "Failed", role
        assert "from its Job" in result.message
        verdict, _ = analysis.run(spec.analysis, [Measurement(check.key, {"value": 0.0}, final=True)], [],
                                  stable_pods=True)
        assert verdict == "Successful"
