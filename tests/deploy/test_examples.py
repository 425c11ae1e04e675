"""The example manifests: what a cluster would accept, what the operator would accept, and what
the engine actually provides."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

from graft.engine.patches.bundle import BundleVerifier, digest_of, load_bundle
from graft.engine.patches.registry import discover
from graft.rollout.spec import parse_spec, template_refs
from tests.deploy.manifests import (EXAMPLES, containers, crd_errors, env_of, load_file, of_kind, one,
                                    pod_template, selects, validation_errors)

FILES = sorted(EXAMPLES.glob("*.yaml"))
ROLLOUTS = [(path, obj) for path in FILES for obj in load_file(path) if obj["kind"] == "PatchRollout"]
OTHERS = [(path, obj) for path in FILES for obj in load_file(path) if obj["kind"] != "PatchRollout"]
TEMPLATE_KINDS = {"PatchAnalysisTemplate": False, "ClusterPatchAnalysisTemplate": True}
# the analysis templates the examples define, by (name, cluster-scoped) as a rollout names them
TEMPLATE_OBJECTS = {(obj["metadata"]["name"], TEMPLATE_KINDS[obj["kind"]]): obj
                    for _, obj in OTHERS if obj["kind"] in TEMPLATE_KINDS}
TEMPLATES = {ref: obj["spec"] for ref, obj in TEMPLATE_OBJECTS.items()}
ENGINE_EXAMPLE = EXAMPLES / "engine-deployment.yaml"


def ids(pairs: list[tuple[Path, dict]]) -> list[str]:
    return [f'{path.stem}:{obj["kind"]}/{obj["metadata"]["name"]}' for path, obj in pairs]


def test_examples_cover_every_way_to_roll_out():
    names = {path.name for path in FILES}
    assert {"engine-deployment.yaml", "rollout-builtin.yaml", "rollout-bundle.yaml", "rollout-gateway-api.yaml",
            "rollout-custom-query.yaml", "rollout-dry-run.yaml", "rollout-fault-test.yaml", "rollout-cpu-fleet.yaml",
            "analysis-template-gpu.yaml", "rollout-with-template.yaml", "rollout-with-hooks.yaml"} <= names
    patches = {obj["spec"]["patch"]["name"] for _, obj in ROLLOUTS}
    assert {"kv-align", "prefill-fusion", "sync-free", "fault"} <= patches
    assert len({obj["metadata"]["name"] for _, obj in ROLLOUTS}) == len(ROLLOUTS)


def stored(obj: dict, crds) -> dict:
    """The object as the API server stores it: pruned and defaulted by its CRD."""
    version = crds[(obj["apiVersion"], obj["kind"])]
    body = copy.deepcopy(obj)
    version.prune(body)
    version.default(body)
    return body


@pytest.mark.parametrize("path, rollout", ROLLOUTS, ids=ids(ROLLOUTS))
def test_patchrollout_example_is_accepted_by_the_crd_and_the_operator(crds, path, rollout):
    version = crds[(rollout["apiVersion"], rollout["kind"])]
    assert crd_errors(rollout, version) == []
    # what the operator reads back: the stored rollout and the stored templates it names
    templates = {ref: stored(TEMPLATE_OBJECTS[ref], crds)["spec"]
                 for ref in template_refs(rollout["spec"]) if ref in TEMPLATE_OBJECTS}
    spec = parse_spec(stored(rollout, crds)["spec"], templates)
    assert spec == parse_spec(rollout["spec"], TEMPLATES), "the stored object means what the file says"
    # the examples ask the operator's Prometheus (GRAFT_PROMETHEUS_ADDRESS, the chart's prometheus.address)
    assert spec.analysis.prometheus.address == "", path.name


def test_every_example_rollout_says_how_it_is_judged():
    """Each example names the analysis it runs: the defaults, its own breakers and gates, or a template
    the examples define; none still uses the removed metrics list or minRequests."""
    for path, rollout in ROLLOUTS:
        analysis = rollout["spec"].get("analysis") or {}
        assert not {"metrics", "minRequests"} & set(analysis), path.name
        for ref in template_refs(rollout["spec"]):
            assert ref in TEMPLATES, f"{path.name}: names template {ref}, which no example defines"


def test_gpu_checklist_template_is_the_documented_one():
    spec = parse_spec({"selector": {"matchLabels": {"app": "llm-engine"}},
                       "patch": {"name": "kv-align", "version": "3.2.1"},
                       "analysis": {"templates": [{"name": "gpu-canary-checklist", "clusterScope": True}]}},
                      TEMPLATES)
    checks = {c.key: (c.metric, c.max, c.min, c.window_text, c.consecutive if c.role == "breaker" else None)
              for c in spec.analysis.checks}
    assert checks == {
        "breaker/ttft-p99": ("ttft-p99", 0.8, None, "30s", 1),
        "breaker/error-rate": ("error-rate", 0.005, None, "60s", 3),
        "breaker/cpu": ("cpu", 0.92, None, "120s", 1),
        "breaker/output-divergence": ("output-divergence", 0.05, None, "rollout", 1),
        "gate/success-rate": ("success-rate", None, 0.9995, "60s", None),
        "gate/error-rate-delta": ("error-rate-delta", 0.001, None, "step", None),
    }
    rollout = one(load_file(EXAMPLES / "rollout-with-template.yaml"), "PatchRollout")
    assert parse_spec(rollout["spec"], TEMPLATES).analysis == spec.analysis


def test_cpu_fleet_example_differs_from_the_defaults_only_where_its_comment_says():
    """The demo's kv-align rollout: the default steps and breakers (cpu run dry), one gate sized for
    the fleet and room for the runs it takes to settle."""
    rollout = one(load_file(EXAMPLES / "rollout-cpu-fleet.yaml"), "PatchRollout")
    mine, defaults = parse_spec(rollout["spec"]), parse_spec({**rollout["spec"], "analysis": {}})
    assert mine.steps == defaults.steps
    assert [dataclasses.replace(c, dry_run=False) for c in mine.analysis.breakers] == list(defaults.analysis.breakers)
    assert [c.key for c in mine.analysis.breakers if c.dry_run] == ["breaker/cpu"]
    (gate,) = mine.analysis.gates
    assert (gate.key, gate.max, gate.window) == ("gate/error-rate-delta", 0.05, None)
    assert (mine.analysis.inconclusive_limit, defaults.analysis.inconclusive_limit) == (60, 20)


def test_crd_check_refuses_a_broken_rollout(crds):
    # the check above must be able to fail: a typo and an out-of-range weight
    _, rollout = ROLLOUTS[0]
    broken = {**rollout, "spec": {**rollout["spec"], "stepz": [], "steps": [{"weight": 150}]}}
    errors = crd_errors(broken, crds[(rollout["apiVersion"], rollout["kind"])])
    assert "spec.stepz: unknown field" in errors
    assert any(e.startswith("spec.steps[0].weight") for e in errors)


@pytest.mark.parametrize("path, obj", OTHERS, ids=ids(OTHERS))
def test_other_example_objects_are_valid_kubernetes(crds, path, obj):
    assert validation_errors(obj, crds) == []


def test_example_rollouts_name_patches_the_engine_provides():
    available = discover(include_test=True)
    for path, rollout in ROLLOUTS:
        patch = rollout["spec"]["patch"]
        if "builtin" not in patch.get("source", {"builtin": {}}):
            continue
        ref = f'{patch["name"]}@{patch["version"]}'
        assert ref in available, f"{path.name}: the engine has no built-in patch {ref}"
        # test-only patches belong to the drills alone (the fault drill, the silent-drift drill)
        assert available[ref].test_only == path.name.endswith("-test.yaml"), path.name


def test_bundle_example_is_pinned_to_its_source_and_loads():
    objs = load_file(EXAMPLES / "rollout-bundle.yaml")
    rollout = one(objs, "PatchRollout")
    source = rollout["spec"]["patch"]["source"]
    config_map = one(objs, "ConfigMap", source["configMap"]["name"])
    module = config_map["data"][source["configMap"]["key"]]
    assert digest_of(module) == source["digest"] == config_map["metadata"]["annotations"]["graft.dev/digest"]
    BundleVerifier([], allow_unsigned=True).verify(module, source["digest"], None,
                                                   name=rollout["spec"]["patch"]["name"],
                                                   version=rollout["spec"]["patch"]["version"])
    provided = {p.id for p in load_bundle(module, source["digest"])}
    assert f'{rollout["spec"]["patch"]["name"]}@{rollout["spec"]["patch"]["version"]}' in provided


def test_gateway_example_routes_between_the_services_it_names():
    objs = load_file(EXAMPLES / "rollout-gateway-api.yaml")
    routing = one(objs, "PatchRollout")["spec"]["trafficRouting"]["gatewayAPI"]
    route = one(objs, "HTTPRoute", routing["httpRoute"])
    weights = {ref["name"]: ref["weight"] for rule in route["spec"]["rules"] for ref in rule["backendRefs"]}
    assert weights == {routing["stableService"]: 100, routing["canaryService"]: 0}
    engine_labels = pod_template(one(load_file(ENGINE_EXAMPLE), "Deployment"))["metadata"]["labels"]
    for name, track in ((routing["stableService"], "stable"), (routing["canaryService"], "canary")):
        selector = one(objs, "Service", name)["spec"]["selector"]
        assert selector["graft.dev/track"] == track
        assert selects({k: v for k, v in selector.items() if k != "graft.dev/track"}, engine_labels)


def test_engine_example_keeps_the_engine_contract():
    objs = load_file(ENGINE_EXAMPLE)
    deployment = one(objs, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    template = pod_template(deployment)
    (engine,) = containers(deployment)
    assert engine["args"][:6] == ["serve", "--host=0.0.0.0", "--port=8000", "--admin-host=$(POD_IP)",
                                  "--admin-port=8081", "--metrics-port=9400"]
    # /metrics on the port named `metrics`, where the scrape annotations point, apart from the public port
    ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
    assert ports == {"http": 8000, "metrics": 9400, "admin": 8081}
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
    env = env_of(engine)
    # the admin API listens on the pod IP only (its default is loopback, out of the operator's reach)
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["GRAFT_PATCHES"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['graft.dev/patches']"
    token_dir = env["GRAFT_ADMIN_TOKEN_FILE"]["value"].rsplit("/", 1)[0]
    mount = next(m for m in engine["volumeMounts"] if m["mountPath"] == token_dir)
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "graft-admin-token"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert engine["securityContext"]["readOnlyRootFilesystem"] is True
    assert engine["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert template["spec"]["securityContext"]["runAsNonRoot"] is True
    (service,) = of_kind(objs, "Service")
    assert [p["port"] for p in service["spec"]["ports"]] == [8000]
    assert selects(service["spec"]["selector"], template["metadata"]["labels"])
    # every example rollout picks these pods
    for path, rollout in ROLLOUTS:
        assert selects(rollout["spec"]["selector"]["matchLabels"], template["metadata"]["labels"]), path.name
