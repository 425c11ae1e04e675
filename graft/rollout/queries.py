"""The built-in PromQL checks and the templating of custom ones.

Canary and stable traffic are told apart by the `revision` label every request metric carries
(`graft_requests_total{revision,status}`, `graft_request_duration_seconds_bucket{revision,le}`), and
restricted to the rollout's namespace by the `namespace` label that a Kubernetes scrape config
attaches to every target. Process metrics carry no revision: `cpu` joins them on `instance` with
`graft_engine_revision_info{revision}`, which each engine exports for its current revision.

Custom queries may use `{{namespace}}`, `{{canaryRevision}}`, `{{stableRevision}}`, `{{window}}`,
`{{patchName}}` and `{{patchVersion}}`; a query that uses `{{stableRevision}}` is a comparison and
needs stable traffic.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from graft.rollout.durations import promql_duration

TEMPLATE_VARS = ("namespace", "canaryRevision", "stableRevision", "window", "patchName", "patchVersion")
_VAR = re.compile(r"\{\{\s*([A-Za-z]+)\s*\}\}")

def _requests(revision: str, status: str = "") -> str:
    matcher = f',status="{status}"' if status else ""
    return f'graft_requests_total{{namespace="{{{{namespace}}}}",revision="{revision}"{matcher}}}'


def _rate(revision: str, status: str = "") -> str:
    return f"sum(rate({_requests(revision, status)}[{{{{window}}}}]))"


def _ratio(revision: str, status: str) -> str:
    # a status never seen has no series at all: count it as zero, not as "no data"
    return f"(({_rate(revision, status)} or vector(0)) / {_rate(revision)})"


CANARY, STABLE = "{{canaryRevision}}", "{{stableRevision}}"

BUILTIN_QUERIES: dict[str, str] = {
    "error-rate": _ratio(CANARY, "error"),
    "success-rate": _ratio(CANARY, "ok"),
    "latency-p99": (
        "histogram_quantile(0.99, sum by (le) (rate(graft_request_duration_seconds_bucket"
        '{namespace="{{namespace}}",revision="{{canaryRevision}}"}[{{window}}])))'
    ),
    "cpu": (
        'avg(rate(process_cpu_seconds_total{namespace="{{namespace}}"}[{{window}}])'
        " and on(namespace, instance)"
        ' (graft_engine_revision_info{namespace="{{namespace}}",revision="{{canaryRevision}}"} == 1))'
    ),
    "error-rate-delta": f"({_ratio(CANARY, 'error')} - {_ratio(STABLE, 'error')})",
}

# Checks judged without a traffic floor: they do not measure requests.
UNGATED = frozenset({"cpu"})

REQUESTS_QUERY = f"sum(increase({_requests('{{revision}}')}[{{{{window}}}}]))"


def template_vars(template: str) -> list[str]:
    return _VAR.findall(template)


def unknown_vars(template: str) -> list[str]:
    return [v for v in template_vars(template) if v not in TEMPLATE_VARS]


def is_comparison(template: str) -> bool:
    """A check that compares canary with stable: meaningless once no stable pod is left."""
    return "stableRevision" in template_vars(template)


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def render(template: str, variables: dict[str, str]) -> str:
    """Fill `{{name}}` placeholders; values are escaped for a PromQL string literal."""
    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name not in variables:
            raise KeyError(f"unknown template variable {{{{{name}}}}}")
        return _quote(variables[name])
    return _VAR.sub(sub, template)


@dataclass(slots=True, frozen=True)
class MetricQuery:
    """What the provider runs for one check: its value, and the traffic behind it."""

    name: str
    value: str
    requests: str | None          # canary requests in the window (None: not gated)
    stable_requests: str | None   # stable requests in the window (comparisons only)


def build_queries(checks, *, namespace: str, canary: str, stable: str,
                  patch_name: str, patch_version: str) -> list[MetricQuery]:
    """The queries for `checks` (spec MetricCheck objects) of one rollout."""
    out = []
    for check in checks:
        template = check.query or BUILTIN_QUERIES[check.name]
        variables = {"namespace": namespace, "canaryRevision": canary, "stableRevision": stable,
                     "window": promql_duration(check.window), "patchName": patch_name, "patchVersion": patch_version}
        gated = check.query is not None or check.name not in UNGATED
        requests = stable_requests = None
        if gated:
            requests = render(REQUESTS_QUERY, {**variables, "revision": canary})
            if is_comparison(template):
                stable_requests = render(REQUESTS_QUERY, {**variables, "revision": stable})
        out.append(MetricQuery(check.name, render(template, variables), requests, stable_requests))
    return out
