"""One verdict for every manifest: the CRD (through the API server emulator, which applies the schema
and evaluates CEL rules as kube-apiserver does) and parse_spec (what the operator checks, against an
older CRD or an API server that skips rules) accept and refuse the same specs, naming the same field.
The same holds for PatchFleets (parse_fleet_spec) and both analysis template kinds (read by parse_spec
for a rollout that names them). Both sides now come from graft.rollout.models; the cases include
where they once drifted apart (an upper-case digest, unbounded durations, keys and arguments, a
Secret name the CRD took).

Except for what a structural schema cannot say (OPERATOR_ONLY): a step's `pause` is a duration string
or `{}` (a manual approval step, Argo Rollouts' spelling), and a field that may be either has no type,
so CEL rules cannot see it and the schema refuses only a bad string or an object with fields in it.
The API server admits the rest; the operator refuses it (InvalidSpec) before it touches a pod.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import aiohttp
import pytest

from graft.devcluster.apiserver import ApiServer
from graft.rollout.spec import SpecError, parse_fleet_spec, parse_spec

ROOT = Path(__file__).resolve().parents[2]
ROLLOUTS = "/apis/graft.dev/v1alpha1/namespaces/default/patchrollouts"
DIGEST = "sha256:" + "ab" * 32
VALID = {
    "selector": {"matchLabels": {"app": "llm-engine"}},
    "patch": {"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}},
    "steps": [{"weight": 10, "pause": "1m"}, {"weight": 100}],
    "analysis": {"interval": "30s",
                 "breakers": [{"name": "error-rate", "max": 0.005, "window": "60s", "consecutive": 3},
                              {"name": "tpot-p99", "maxRatio": 1.3}],
                 "gates": [{"name": "error-rate-delta", "max": 0.001}]},
}


def setting(path: str, value):
    """A change to VALID: `path` dotted (list indexes as numbers); value DELETE removes the field."""
    def change(spec):
        keys = [int(k) if k.isdigit() else k for k in path.split(".")]
        node = spec
        for k in keys[:-1]:
            node = node[k]
        if value is DELETE:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
        return spec
    return change


DELETE = object()
# (id, change, the field the refusal must name)
JOB_SPEC = {"template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}}
INVALID = [
    ("no-selector", setting("selector", DELETE), "spec.selector"),
    ("empty-selector", setting("selector", {"matchLabels": {}}), "spec.selector"),
    ("selector-key-injection", setting("selector.matchLabels", {"zzz!": "q"}), "spec.selector.matchLabels"),
    ("selector-matches-all-notin", setting("selector", {"matchExpressions": [
        {"key": "app", "operator": "NotIn", "values": ["nothing"]}]}), "spec.selector"),
    ("selector-matches-all-doesnotexist", setting("selector", {"matchExpressions": [
        {"key": "nope", "operator": "DoesNotExist"}]}), "spec.selector"),
    ("selector-any-app", setting("selector", {"matchExpressions": [
        {"key": "app", "operator": "Exists"}, {"key": "db", "operator": "NotIn", "values": ["x"]}]}), "spec.selector"),
    ("selector-value-comma", setting("selector.matchLabels", {"app": "a,b"}), "spec.selector.matchLabels"),
    ("selector-value-64", setting("selector.matchLabels", {"app": "a" * 64}), "spec.selector.matchLabels"),
    ("selector-bad-operator", setting("selector", {"matchExpressions": [{"key": "app", "operator": "Near"}]}),
     "spec.selector.matchExpressions[0].operator"),
    ("selector-expression-no-key", setting("selector", {"matchExpressions": [{"operator": "Exists"}]}),
     "spec.selector.matchExpressions[0].key"),
    ("no-patch", setting("patch", DELETE), "spec.patch"),
    ("patch-no-name", setting("patch.name", DELETE), "spec.patch.name"),
    ("patch-no-version", setting("patch.version", DELETE), "spec.patch.version"),
    ("patch-name-upper", setting("patch.name", "KV"), "spec.patch.name"),
    ("patch-name-newline", setting("patch.name", "nl\n"), "spec.patch.name"),
    ("patch-name-dash-end", setting("patch.name", "kv-"), "spec.patch.name"),
    ("patch-name-64", setting("patch.name", "a" * 64), "spec.patch.name"),
    ("patch-version-space", setting("patch.version", "3 2"), "spec.patch.version"),
    ("patch-version-newline", setting("patch.version", "3.2.1\n"), "spec.patch.version"),
    ("patch-version-65", setting("patch.version", "1" * 65), "spec.patch.version"),
    ("source-both", setting("patch.source", {"builtin": {}, "configMap": {"name": "b", "key": "p.py"},
                                            "digest": DIGEST}), "spec.patch.source"),
    ("source-configmap-no-digest", setting("patch.source", {"configMap": {"name": "b", "key": "p.py"}}),
     "spec.patch.source"),
    ("source-bad-digest", setting("patch.source", {"configMap": {"name": "b", "key": "p.py"},
                                                  "digest": "sha256:XYZ"}), "spec.patch.source.digest"),
    ("source-digest-newline", setting("patch.source", {"configMap": {"name": "b", "key": "p.py"},
                                                      "digest": DIGEST + "\n"}), "spec.patch.source.digest"),
    ("source-configmap-no-key", setting("patch.source", {"configMap": {"name": "b"}, "digest": DIGEST}),
     "spec.patch.source.configMap.key"),
    ("source-configmap-bad-name", setting("patch.source", {"configMap": {"name": "B_b", "key": "k"},
                                                          "digest": DIGEST}), "spec.patch.source.configMap.name"),
    ("routing-both", setting("trafficRouting", {"podRatio": {}, "gatewayAPI": {
        "httpRoute": "r", "stableService": "s", "canaryService": "c"}}), "spec.trafficRouting"),
    ("routing-gateway-missing-route", setting("trafficRouting", {"gatewayAPI": {
        "stableService": "s", "canaryService": "c"}}), "spec.trafficRouting.gatewayAPI.httpRoute"),
    ("routing-same-services", setting("trafficRouting", {"gatewayAPI": {
        "httpRoute": "r", "stableService": "s", "canaryService": "s"}}), "spec.trafficRouting.gatewayAPI"),
    ("steps-empty", setting("steps", []), "spec.steps"),
    ("steps-21", setting("steps", [{"weight": w} for w in range(80, 100)] + [{"weight": 100}]), "spec.steps"),
    ("steps-last-not-100", setting("steps", [{"weight": 10}, {"weight": 50}]), "spec.steps"),
    ("steps-decreasing", setting("steps", [{"weight": 50}, {"weight": 10}, {"weight": 100}]), "spec.steps"),
    ("steps-repeated", setting("steps", [{"weight": 50}, {"weight": 50}, {"weight": 100}]), "spec.steps"),
    ("step-weight-0", setting("steps", [{"weight": 0}, {"weight": 100}]), "spec.steps[0].weight"),
    ("step-weight-101", setting("steps", [{"weight": 10}, {"weight": 101}]), "spec.steps[1].weight"),
    ("step-weight-float", setting("steps", [{"weight": 10.5}, {"weight": 100}]), "spec.steps[0].weight"),
    ("step-weight-string", setting("steps", [{"weight": "10"}, {"weight": 100}]), "spec.steps[0].weight"),
    ("step-no-weight", setting("steps", [{"pause": "1m"}, {"weight": 100}]), "spec.steps[0].weight"),
    ("step-pause-words", setting("steps.0.pause", "one minute"), "spec.steps[0].pause"),
    ("step-pause-negative", setting("steps.0.pause", "-1m"), "spec.steps[0].pause"),
    ("step-pause-newline", setting("steps.0.pause", "1m\n"), "spec.steps[0].pause"),
    ("step-unknown-field", setting("steps.0.colour", "red"), "spec.steps[0].colour"),
    ("step-pause-object-with-fields", setting("steps.0.pause", {"x": 1}), "spec.steps[0].pause"),
    ("step-pause-argo-duration-object", setting("steps.0.pause", {"duration": "10m"}), "spec.steps[0].pause"),
    ("step-until-approved-string", setting("steps.0.untilApproved", "yes"), "spec.steps[0].untilApproved"),
    ("interval-words", setting("analysis.interval", "often"), "spec.analysis.interval"),
    ("interval-days", setting("analysis.interval", "1d"), "spec.analysis.interval"),
    ("no-data-policy", setting("analysis.noData", "ignore"), "spec.analysis.noData"),
    ("webhook-unknown-type", setting("webhooks", [{"name": "h", "type": "pre-promotion", "url": "http://h/"}]),
     "spec.webhooks[0].type"),
    ("webhook-no-url", setting("webhooks", [{"name": "h", "type": "event"}]), "spec.webhooks[0].url"),
    ("webhook-url-not-http", setting("webhooks", [{"name": "h", "type": "event", "url": "file:///etc/passwd"}]),
     "spec.webhooks[0].url"),
    ("webhook-name-upper", setting("webhooks", [{"name": "Gate", "type": "event", "url": "http://h/"}]),
     "spec.webhooks[0].name"),
    ("webhook-twice", setting("webhooks", [{"name": "h", "type": "event", "url": "http://h/"},
                                           {"name": "h", "type": "rollout", "url": "http://h/"}]), "spec.webhooks[1]"),
    ("webhook-retries-6", setting("webhooks", [{"name": "h", "type": "event", "url": "http://h/", "retries": 6}]),
     "spec.webhooks[0].retries"),
    ("webhook-timeout-words", setting("webhooks", [{"name": "h", "type": "event", "url": "http://h/",
                                                    "timeout": "soon"}]), "spec.webhooks[0].timeout"),
    ("webhooks-17", setting("webhooks", [{"name": f"h{i}", "type": "event", "url": "http://h/"} for i in range(17)]),
     "spec.webhooks"),
    ("notification-unknown-moment", setting("notifications", [{"receiver": "chat", "moments": ["finished"]}]),
     "spec.notifications[0].moments"),
    ("notification-no-receiver", setting("notifications", [{"moments": ["promoted"]}]),
     "spec.notifications[0].receiver"),
    ("notification-twice", setting("notifications", [{"receiver": "chat"}, {"receiver": "chat"}]),
     "spec.notifications[1]"),
    ("confidence-high", setting("analysis.confidence", 1.0), "spec.analysis.confidence"),
    ("confidence-low", setting("analysis.confidence", 0.2), "spec.analysis.confidence"),
    ("confidence-string", setting("analysis.confidence", "0.95"), "spec.analysis.confidence"),
    ("inconclusive-limit-negative", setting("analysis.inconclusiveLimit", -1), "spec.analysis.inconclusiveLimit"),
    ("error-limit-float", setting("analysis.errorLimit", 1.5), "spec.analysis.errorLimit"),
    ("retention-101", setting("analysis.measurementRetention", 101), "spec.analysis.measurementRetention"),
    ("retention-negative", setting("analysis.measurementRetention", -1), "spec.analysis.measurementRetention"),
    ("retention-string", setting("analysis.measurementRetention", "10"), "spec.analysis.measurementRetention"),
    ("prometheus-not-url", setting("analysis.prometheus", {"address": "prometheus:9090"}),
     "spec.analysis.prometheus.address"),
    ("prometheus-space", setting("analysis.prometheus", {"address": "http://a b"}),
     "spec.analysis.prometheus.address"),
    ("check-name-upper", setting("analysis.breakers.0.name", "Error-Rate"), "spec.analysis.breakers[0].name"),
    ("check-custom-no-query", setting("analysis.breakers.1", {"name": "mine", "max": 1}), "spec.analysis.breakers[1]"),
    ("check-no-threshold", setting("analysis.breakers.1", {"name": "tpot-p99"}), "spec.analysis.breakers[1]"),
    ("check-min-over-max", setting("analysis.breakers.1", {"name": "x", "query": "up", "min": 2, "max": 1}),
     "spec.analysis.breakers[1]"),
    ("check-metric-and-query", setting("analysis.gates.0", {"name": "x", "metric": "cpu", "query": "up", "max": 1}),
     "spec.analysis.gates[0]"),
    ("check-unknown-metric", setting("analysis.gates.0", {"name": "x", "metric": "vibes", "max": 1}),
     "spec.analysis.gates[0].metric"),
    ("check-consecutive-0", setting("analysis.breakers.0.consecutive", 0), "spec.analysis.breakers[0].consecutive"),
    ("check-window-words", setting("analysis.breakers.0.window", "a while"), "spec.analysis.breakers[0].window"),
    ("check-ratio-zero", setting("analysis.breakers.1.maxRatio", 0), "spec.analysis.breakers[1].maxRatio"),
    ("check-ratio-string", setting("analysis.breakers.1.maxRatio", "1.3"), "spec.analysis.breakers[1].maxRatio"),
    ("check-query-8k", setting("analysis.breakers.1", {"name": "x", "query": "u" * 8193, "max": 1}),
     "spec.analysis.breakers[1].query"),
    ("checks-duplicate", setting("analysis.breakers.1", {"name": "error-rate", "max": 0.01}),
     "spec.analysis.breakers[1]"),
    ("checks-21", setting("analysis.breakers", [{"name": f"c{i}", "query": "up", "max": 1} for i in range(21)]),
     "spec.analysis.breakers"),
    ("check-unknown-field", setting("analysis.breakers.0.colour", "red"), "spec.analysis.breakers[0].colour"),
    ("template-bad-name", setting("analysis.templates", [{"name": "Not_A_Name"}]), "spec.analysis.templates[0].name"),
    ("action-unknown", setting("action", "rewind"), "spec.action"),
    ("deadline-words", setting("progressDeadline", "soon"), "spec.progressDeadline"),
    ("paused-string", setting("paused", "yes"), "spec.paused"),
    ("ttl-negative", setting("ttlSecondsAfterFinished", -1), "spec.ttlSecondsAfterFinished"),
    ("ttl-float", setting("ttlSecondsAfterFinished", 1.5), "spec.ttlSecondsAfterFinished"),
    ("ttl-string", setting("ttlSecondsAfterFinished", "1h"), "spec.ttlSecondsAfterFinished"),
    ("unknown-top-field", setting("replicas", 3), "spec.replicas"),
    # where the CRD and the operator's reader once disagreed (both now read graft.rollout.models)
    ("source-digest-upper-case", setting("patch.source", {"configMap": {"name": "b", "key": "p.py"},
                                                         "digest": DIGEST.upper().replace("SHA256", "sha256")}),
     "spec.patch.source.digest"),
    ("source-builtin-with-digest", setting("patch.source", {"builtin": {}, "digest": DIGEST}), "spec.patch.source"),
    ("interval-33-characters", setting("analysis.interval", "1" * 32 + "s"), "spec.analysis.interval"),
    ("outage-limit-33-characters", setting("analysis.outageLimit", "0" * 32 + "s"), "spec.analysis.outageLimit"),
    ("deadline-33-characters", setting("progressDeadline", "1" * 32 + "m"), "spec.progressDeadline"),
    # 400 digits once parsed to inf seconds and broke query planning
    ("window-400-digits", setting("analysis.breakers.0.window", "1" * 399 + "s"), "spec.analysis.breakers[0].window"),
    ("selector-expression-value-64", setting("selector", {"matchExpressions": [
        {"key": "app", "operator": "In", "values": ["a" * 64]}]}), "spec.selector.matchExpressions[0].values[0]"),
    ("selector-in-without-values", setting("selector", {"matchLabels": {"app": "llm-engine"}, "matchExpressions": [
        {"key": "tier", "operator": "In"}]}), "spec.selector.matchExpressions[0]"),
    ("configmap-key-254", setting("patch.source", {"configMap": {"name": "b", "key": "k" * 254}, "digest": DIGEST}),
     "spec.patch.source.configMap.key"),
    ("configmap-key-slash", setting("patch.source", {"configMap": {"name": "b", "key": "a/p.py"}, "digest": DIGEST}),
     "spec.patch.source.configMap.key"),
    ("prometheus-address-2049", setting("analysis.prometheus", {"address": "http://" + "p" * 2042}),
     "spec.analysis.prometheus.address"),
    ("secret-name-not-dns", setting("analysis.prometheus", {"bearerTokenSecret": {"name": "Prom_Token", "key": "t"}}),
     "spec.analysis.prometheus.bearerTokenSecret.name"),
    ("secret-key-254", setting("analysis.prometheus", {"caSecret": {"name": "prom-ca", "key": "k" * 254}}),
     "spec.analysis.prometheus.caSecret.key"),
    ("header-value-newline", setting("analysis.prometheus", {"headers": [{"name": "X-Org", "value": "a\nb"}]}),
     "spec.analysis.prometheus.headers[0].value"),
    ("prometheus-two-logins", setting("analysis.prometheus", {
        "bearerTokenSecret": {"name": "t", "key": "k"},
        "basicAuth": {"username": "graft", "passwordSecret": {"name": "p", "key": "k"}}}), "spec.analysis.prometheus"),
    ("prometheus-basic-username-colon", setting("analysis.prometheus", {
        "basicAuth": {"username": "a:b", "passwordSecret": {"name": "p", "key": "k"}}}),
     "spec.analysis.prometheus.basicAuth.username"),
    ("prometheus-oauth2-token-url-not-http", setting("analysis.prometheus", {"oauth2": {
        "tokenUrl": "ftp://idp/token", "clientId": "graft", "clientSecretSecret": {"name": "c", "key": "k"}}}),
     "spec.analysis.prometheus.oauth2.tokenUrl"),
    ("prometheus-tls-without-key", setting("analysis.prometheus", {"tls": {"certSecret": {"name": "c", "key": "k"}}}),
     "spec.analysis.prometheus.tls.keySecret"),
    ("web-and-query", setting("analysis.breakers.0", {"name": "q", "max": 1, "query": 'up{namespace="{{namespace}}"}',
                                                      "web": {"url": "http://e/q", "jsonPath": "$.q"}}),
     "spec.analysis.breakers[0]"),
    ("web-get-with-body", setting("analysis.breakers.0", {"name": "q", "max": 1, "web": {
        "url": "http://e/q", "jsonPath": "$.q", "body": "{}"}}), "spec.analysis.breakers[0].web"),
    ("web-timeout-2m", setting("analysis.breakers.0", {"name": "q", "max": 1, "web": {
        "url": "http://e/q", "jsonPath": "$.q", "timeout": "2m"}}), "spec.analysis.breakers[0].web.timeout"),
    ("web-json-path-recursive", setting("analysis.breakers.0", {"name": "q", "max": 1, "web": {
        "url": "http://e/q", "jsonPath": "$..q"}}), "spec.analysis.breakers[0].web.jsonPath"),
    ("web-header-value-and-secret", setting("analysis.breakers.0", {"name": "q", "max": 1, "web": {
        "url": "http://e/q", "jsonPath": "$.q", "headers": [{"name": "A", "value": "v", "valueFrom": {
            "secretKeyRef": {"name": "s", "key": "k"}}}]}}), "spec.analysis.breakers[0].web.headers[0]"),
    ("job-and-web", setting("analysis.gates.0", {"name": "q", "max": 1, "web": {"url": "http://e/q", "jsonPath": "$"},
                                                 "job": {"spec": JOB_SPEC}}), "spec.analysis.gates[0]"),
    ("job-json-path-recursive", setting("analysis.gates.0", {"name": "q", "max": 1, "job": {
        "spec": JOB_SPEC, "jsonPath": "$..d"}}), "spec.analysis.gates[0].job.jsonPath"),
    ("job-timeout-words", setting("analysis.gates.0", {"name": "q", "max": 1, "job": {
        "spec": JOB_SPEC, "timeout": "soon"}}), "spec.analysis.gates[0].job.timeout"),
    ("job-without-spec", setting("analysis.gates.0", {"name": "q", "max": 1, "job": {"jsonPath": "$.d"}}),
     "spec.analysis.gates[0].job.spec"),
    ("template-argument-1025", setting("analysis.args", [{"name": "tenant", "value": "t" * 1025}]),
     "spec.analysis.args[0].value"),
    ("gate-consecutive", setting("analysis.gates.0.consecutive", 2), "spec.analysis.gates"),
]
# valid edge cases both must accept
VALID_EDGES = [
    ("job-with-labels-and-placeholders", setting("analysis.gates.0", {"name": "q", "max": 0.2, "job": {
        "metadata": {"labels": {"app.kubernetes.io/name": "eval"}},
        "spec": {"template": {"spec": {"containers": [{"name": "c", "image": "i",
                                                       "args": ["{{canaryRevision}}", "{{stableRevision}}"]}]}}},
        "jsonPath": "$.difference", "timeout": "1h"}})),
    ("web-post-with-secret-header", setting("analysis.breakers.0", {"name": "q", "max": 1, "web": {
        "url": "https://evals.ml:8443/score?rev={{canaryRevision}}", "method": "POST", "body": '{"a": 1}',
        "jsonPath": "$.data['score'][0]", "timeout": "60s",
        "headers": [{"name": "Authorization", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}})),
    ("prometheus-oauth2-and-mtls", setting("analysis.prometheus", {
        "oauth2": {"tokenUrl": "https://idp.example/token", "clientId": "graft",
                   "clientSecretSecret": {"name": "c", "key": "k"}, "scopes": ["metrics.read"]},
        "tls": {"certSecret": {"name": "m", "key": "tls.crt"}, "keySecret": {"name": "m", "key": "tls.key"}},
        "caSecret": {"name": "m", "key": "ca.crt"}})),
    ("defaults-only", lambda s: {"selector": s["selector"], "patch": s["patch"]}),
    ("expressions-selector", setting("selector", {"matchExpressions": [{"key": "app", "operator": "In",
                                                                        "values": ["a", "b"]}]})),
    ("prefixed-label-key", setting("selector.matchLabels", {"app.kubernetes.io/name": "llm"})),
    ("one-step", setting("steps", [{"weight": 100}])),
    ("manual-step-until-approved", setting("steps", [{"weight": 10, "untilApproved": True}, {"weight": 100}])),
    ("manual-step-argo-pause", setting("steps", [{"weight": 10, "pause": {}}, {"weight": 50, "pause": "1m"},
                                                {"weight": 100, "untilApproved": True}])),
    ("manual-step-both-spellings", setting("steps.0", {"weight": 10, "pause": {}, "untilApproved": True})),
    ("until-approved-false-with-a-duration", setting("steps.0.untilApproved", False)),
    ("twenty-steps", setting("steps", [{"weight": w} for w in range(81, 100)] + [{"weight": 100}])),
    ("revert", setting("action", "revert")),
    ("every-webhook-type", setting("webhooks", [
        {"name": t, "type": t, "url": f"https://ci.example/{t}", "timeout": "5s", "retries": 0,
         "metadata": {"team": "serving", "ticket": "INC-42"}}
        for t in ("confirm-rollout", "pre-rollout", "rollout", "confirm-promotion", "post-rollout", "rollback",
                  "event")])),
    ("notifications-chosen", setting("notifications", [{"receiver": "deploys", "moments": ["promoted", "rolledBack"]},
                                                       {"receiver": "audit"}])),
    ("notifications-none", setting("notifications", [])),
    ("ttl-zero", setting("ttlSecondsAfterFinished", 0)),
    ("no-history", setting("analysis.measurementRetention", 0)),
    ("longest-history", setting("analysis.measurementRetention", 100)),
    ("bundle-source", setting("patch.source", {"configMap": {"name": "b", "key": "p.py"}, "digest": DIGEST})),
    ("gateway", setting("trafficRouting", {"gatewayAPI": {"httpRoute": "r", "stableService": "s",
                                                          "canaryService": "c"}})),
    ("breaker-and-gate-share-a-name", setting("analysis.gates", [{"name": "tpot-p99", "maxRatio": 1.2}])),
    ("output-divergence-both-roles", setting("analysis", {
        "breakers": [{"name": "output-divergence", "max": 0.05, "consecutive": 1}],
        "gates": [{"name": "output-divergence", "max": 0.01, "window": "step"}]})),
    ("output-divergence-by-metric-dry-run", setting("analysis.breakers.1", {
        "name": "divergence-trial", "metric": "output-divergence", "max": 1, "window": "5m", "dryRun": True})),
]


# admitted by the API server (a step's pause is a field without a type: see the module's docstring),
# refused by the operator, naming the field
OPERATOR_ONLY = [
    ("step-pause-and-until-approved", setting("steps.0.untilApproved", True), "spec.steps[0]"),
    ("step-pause-empty-object-not-approved", setting("steps.0", {"weight": 10, "pause": {}, "untilApproved": False}),
     "spec.steps[0]"),
    ("step-pause-number", setting("steps.0.pause", 60), "spec.steps[0].pause"),
    ("step-pause-boolean", setting("steps.0.pause", True), "spec.steps[0].pause"),
    ("step-pause-list", setting("steps.0.pause", ["1m"]), "spec.steps[0].pause"),
    ("webhook-timeout-over-a-minute", setting("webhooks", [{"name": "h", "type": "rollout", "url": "http://h/",
                                                            "timeout": "2m"}]), "spec.webhooks[0].timeout"),
    # a job's spec is free-form in the schema (a JobSpec): the operator checks what it needs of it
    ("job-without-containers", setting("analysis.gates.0", {"name": "q", "max": 1, "job": {
        "spec": {"template": {"spec": {}}}}}), "spec.analysis.gates[0].job.spec.template.spec.containers"),
    ("job-timeout-2h", setting("analysis.gates.0", {"name": "q", "max": 1, "job": {"spec": JOB_SPEC, "timeout": "2h"}}),
     "spec.analysis.gates[0].job.timeout"),
]


@pytest.fixture
async def api():
    async with ApiServer(crd_paths=[ROOT / "crds"]) as server:
        yield server


async def admit(api, spec) -> tuple[int, dict]:
    body = {"apiVersion": "graft.dev/v1alpha1", "kind": "PatchRollout", "metadata": {"generateName": "c-"},
            "spec": spec}
    async with aiohttp.ClientSession(api.url) as http:
        async with http.post(ROLLOUTS + "?fieldValidation=Strict", json=body) as reply:
            return reply.status, json.loads(await reply.text())


def test_the_corpus_is_large_enough():
    assert len(INVALID) >= 60 and len({c[0] for c in INVALID}) == len(INVALID)


@pytest.mark.parametrize("case, change, field", INVALID, ids=[c[0] for c in INVALID])
async def test_both_refuse_naming_the_field(api, case, change, field):
    spec = change(copy.deepcopy(VALID))
    status, answer = await admit(api, spec)
    assert status in (400, 422), (status, answer)
    fields = [c.get("field", "") for c in (answer.get("details") or {}).get("causes") or []]
    text = answer.get("message", "")
    assert any(f.startswith(field) or field.startswith(f) for f in fields if f) or field in text, (field, answer)
    with pytest.raises(SpecError) as refused:
        parse_spec(spec)
    assert any(p == field or p.startswith(field + ".") or p.startswith(field + "[") or field.startswith(p)
               for p in refused.value.paths), (field, refused.value.paths)


@pytest.mark.parametrize("case, change", VALID_EDGES, ids=[c[0] for c in VALID_EDGES])
async def test_both_accept(api, case, change):
    spec = change(copy.deepcopy(VALID))
    status, answer = await admit(api, spec)
    assert status == 201, answer.get("message")
    parse_spec(answer["spec"])            # as stored, defaults filled in by the API server


@pytest.mark.parametrize("case, change, field", OPERATOR_ONLY, ids=[c[0] for c in OPERATOR_ONLY])
async def test_what_only_the_operator_refuses_of_a_pause(api, case, change, field):
    spec = change(copy.deepcopy(VALID))
    status, answer = await admit(api, spec)
    assert status == 201, answer.get("message")
    with pytest.raises(SpecError) as refused:
        parse_spec(answer["spec"])
    assert field in refused.value.paths, (field, refused.value.paths)


def test_the_pause_field_is_structural_and_hidden_from_cel():
    """kube-apiserver takes a field with no type only under x-kubernetes-preserve-unknown-fields, and
    leaves such a field out of what CEL rules see: no rule may name it (it would not compile)."""
    import yaml

    crd = yaml.safe_load((ROOT / "crds" / "patchrollout.yaml").read_text())
    steps = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["steps"]
    pause = steps["items"]["properties"]["pause"]
    assert "type" not in pause and pause["x-kubernetes-preserve-unknown-fields"] is True
    assert pause["maxProperties"] == 0 and pause["pattern"].startswith("^")
    assert steps["items"]["properties"]["untilApproved"]["type"] == "boolean"
    rules = [r["rule"] for r in steps.get("x-kubernetes-validations", [])
             + steps["items"].get("x-kubernetes-validations", [])]
    assert rules and not any("pause" in r for r in rules)


# -- the other kinds: a PatchFleet (parse_fleet_spec) and the analysis templates (read by parse_spec
# for a rollout that names them, errors at the template's own field paths) ---------------------------

FLEETS = "/apis/graft.dev/v1alpha1/namespaces/default/patchfleets"
TEMPLATE_PATHS = {"PatchAnalysisTemplate": "/apis/graft.dev/v1alpha1/namespaces/default/patchanalysistemplates",
                  "ClusterPatchAnalysisTemplate": "/apis/graft.dev/v1alpha1/clusterpatchanalysistemplates"}
FLEET = {"selector": {"matchLabels": {"app": "llm-engine"}},
         "patches": [{"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}},
                     {"name": "sync-free", "version": "1.0.0",
                      "source": {"configMap": {"name": "b", "key": "p.py"}, "digest": DIGEST}}],
         "revisionHistoryLimit": 5}
INVALID_FLEETS = [
    ("no-selector", setting("selector", DELETE), "spec.selector"),
    ("selector-notin-alone", setting("selector", {"matchExpressions": [
        {"key": "app", "operator": "NotIn", "values": ["db"]}]}), "spec.selector"),
    ("selector-value-64", setting("selector.matchLabels", {"app": "a" * 64}), "spec.selector.matchLabels"),
    ("patch-name-upper", setting("patches.0.name", "KV"), "spec.patches[0].name"),
    ("patch-no-version", setting("patches.0.version", DELETE), "spec.patches[0].version"),
    ("patch-twice", setting("patches.1.name", "kv-align"), "spec.patches[1]"),
    ("patches-33", setting("patches", [{"name": f"p{i}", "version": "1"} for i in range(33)]), "spec.patches"),
    ("patch-config-not-object", setting("patches.0.config", "x"), "spec.patches[0].config"),
    ("digest-upper-case", setting("patches.1.source.digest", DIGEST.upper().replace("SHA256", "sha256")),
     "spec.patches[1].source.digest"),
    ("configmap-key-254", setting("patches.1.source.configMap.key", "k" * 254), "spec.patches[1].source.configMap.key"),
    ("builtin-with-digest", setting("patches.0.source", {"builtin": {}, "digest": DIGEST}), "spec.patches[0].source"),
    ("history-limit-negative", setting("revisionHistoryLimit", -1), "spec.revisionHistoryLimit"),
    ("history-limit-string", setting("revisionHistoryLimit", "5"), "spec.revisionHistoryLimit"),
    ("unknown-field", setting("replicas", 3), "spec.replicas"),
]
TEMPLATE = {"args": [{"name": "job", "value": "engine"}, {"name": "tenant"}],
            "breakers": [{"name": "ttft-p99", "maxRatio": 1.5, "consecutive": 2}],
            "gates": [{"name": "success-rate", "min": 0.999, "window": "60s"}]}
INVALID_TEMPLATES = [
    ("breaker-no-threshold", setting("breakers.0", {"name": "cpu"}), "spec.breakers[0]"),
    ("breaker-unknown-metric", setting("breakers.0", {"name": "x", "metric": "vibes", "max": 1}),
     "spec.breakers[0].metric"),
    ("breaker-window-400-digits", setting("breakers.0.window", "1" * 399 + "s"), "spec.breakers[0].window"),
    ("breakers-21", setting("breakers", [{"name": f"c{i}", "query": "up", "max": 1} for i in range(21)]),
     "spec.breakers"),
    ("gate-consecutive", setting("gates.0.consecutive", 3), "spec.gates"),
    ("gate-min-over-max", setting("gates.0", {"name": "x", "query": "up", "min": 2, "max": 1}), "spec.gates[0]"),
    ("arg-name-digit", setting("args.0.name", "1st"), "spec.args[0].name"),
    ("arg-value-1025", setting("args.0.value", "v" * 1025), "spec.args[0].value"),
    ("args-33", setting("args", [{"name": f"a{i}"} for i in range(33)]), "spec.args"),
    ("unknown-field", setting("metrics", []), "spec.metrics"),
]


async def admit_kind(api, kind: str, path: str, spec) -> tuple[int, dict]:
    body = {"apiVersion": "graft.dev/v1alpha1", "kind": kind, "metadata": {"generateName": "c-"}, "spec": spec}
    async with aiohttp.ClientSession(api.url) as http:
        async with http.post(path + "?fieldValidation=Strict", json=body) as reply:
            return reply.status, json.loads(await reply.text())


def refused_at(answer: dict, field: str) -> bool:
    fields = [c.get("field", "") for c in (answer.get("details") or {}).get("causes") or []]
    return any(f.startswith(field) or field.startswith(f) for f in fields if f) or field in answer.get("message", "")


def names(paths: list[str], field: str) -> bool:
    return any(p == field or p.startswith(field + ".") or p.startswith(field + "[") or field.startswith(p)
               for p in paths)


async def test_both_accept_the_fleet(api):
    status, answer = await admit_kind(api, "PatchFleet", FLEETS, FLEET)
    assert status == 201, answer.get("message")
    assert [p.ref for p in parse_fleet_spec(answer["spec"]).patches] == ["kv-align@3.2.1", "sync-free@1.0.0"]


@pytest.mark.parametrize("case, change, field", INVALID_FLEETS, ids=[c[0] for c in INVALID_FLEETS])
async def test_both_refuse_a_fleet_naming_the_field(api, case, change, field):
    spec = change(copy.deepcopy(FLEET))
    status, answer = await admit_kind(api, "PatchFleet", FLEETS, spec)
    assert status in (400, 422) and refused_at(answer, field), (field, answer)
    with pytest.raises(SpecError) as refused:
        parse_fleet_spec(spec)
    assert names(refused.value.paths, field), (field, refused.value.paths)


def read_through_a_rollout(kind: str, spec) -> None:
    """parse_spec for a rollout naming the template, as the operator reads it; SpecError's paths are
    the template's own (`spec.breakers[0]`)."""
    cluster = kind.startswith("Cluster")
    rollout = {**VALID, "analysis": {"templates": [{"name": "t", "clusterScope": cluster}],
                                     "args": [{"name": "tenant", "value": "acme"}]}}
    try:
        parse_spec(rollout, {("t", cluster): spec})
    except SpecError as e:
        prefix = f"{kind} t: "
        raise SpecError([type(x)(x.path.removeprefix(prefix), x.message) for x in e.errors]) from None


@pytest.mark.parametrize("kind", list(TEMPLATE_PATHS))
async def test_both_accept_the_template(api, kind):
    status, answer = await admit_kind(api, kind, TEMPLATE_PATHS[kind], TEMPLATE)
    assert status == 201, answer.get("message")
    read_through_a_rollout(kind, answer["spec"])


@pytest.mark.parametrize("kind", list(TEMPLATE_PATHS))
@pytest.mark.parametrize("case, change, field", INVALID_TEMPLATES, ids=[c[0] for c in INVALID_TEMPLATES])
async def test_both_refuse_a_template_naming_the_field(api, kind, case, change, field):
    spec = change(copy.deepcopy(TEMPLATE))
    status, answer = await admit_kind(api, kind, TEMPLATE_PATHS[kind], spec)
    assert status in (400, 422) and refused_at(answer, field), (field, answer)
    with pytest.raises(SpecError) as refused:
        read_through_a_rollout(kind, spec)
    assert names(refused.value.paths, field), (field, refused.value.paths)
