"""What the analysis asks Prometheus: a plan of plain numbers per check, and its PromQL.

Each check needs a few numbers, not one: an error-rate check needs the canary's requests and errors
in its window (the verdict is judged on counts), a ratio check needs a quantile on each side and how
many samples each rests on. `analysis.plan_run()` lists them as `Series`, each one number with its
PromQL. The operator runs the PromQL; the simulator (graft.rollout.simulate) computes the same numbers from its
simulated fleet; both hand them to the same judge (graft.rollout.analysis).

Canary and stable traffic are told apart by the `revision` label every request metric carries, and
restricted to the rollout's namespace by the `namespace` label that a Kubernetes scrape config
attaches to every target. Process metrics carry no revision: `cpu` joins them on `instance` with
`graft_engine_revision_info{revision}`, which each engine exports for its current revision, and
divides by `graft_cpu_quota_cores` (the container's CPU limit), so 0.92 means 92% of its quota.
`output-divergence` counts the canary engines' shadow comparisons (`graft_shadow_requests_total`,
by `result`: `agree`, `divergent`, `error`): each canary compares a share of its finished requests
with the table it ran before the patch, so the canary's own series are the whole comparison.

Custom queries may use `{{namespace}}`, `{{canaryRevision}}`, `{{stableRevision}}`, `{{window}}`,
`{{patchName}}`, `{{patchVersion}}` and a template's `{{args.NAME}}`; a query that uses
`{{stableRevision}}` is a comparison and needs stable traffic.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from graft.rollout.durations import promql_duration

TEMPLATE_VARS = ("namespace", "canaryRevision", "stableRevision", "window", "patchName", "patchVersion")
_VAR = re.compile(r"\{\{\s*([A-Za-z]+)\s*\}\}")
_ARG = re.compile(r"\{\{\s*args\.([A-Za-z][A-Za-z0-9_]*)\s*\}\}")

CANARY, STABLE = "canary", "stable"
REQUESTS = "graft_requests_total"
SHADOW = "graft_shadow_requests_total"
# shadow comparison results: a compared request agrees or diverges; `error` (the comparison itself
# failed) is neither and is left out of both counts
COMPARED, DIVERGENT = "compared", "divergent"
COMPARED_RESULTS = ("agree", DIVERGENT)
# the histogram behind each built-in quantile check, and its quantile
QUANTILES: dict[str, tuple[str, float]] = {
    "latency-p99": ("graft_request_duration_seconds", 0.99),
    "ttft-p99": ("graft_time_to_first_token_seconds", 0.99),
    "tpot-p99": ("graft_inter_token_latency_seconds", 0.99),
}


@dataclass(slots=True, frozen=True)
class Series:
    """One number a check needs. `key` names it for the judge; `promql` asks Prometheus for it.

    kind: count (requests of `side` with `status`, or all; `failed` is `error` or `abandoned`),
    shadow (the canary's shadow comparisons: `compared`, agreeing or divergent, or `divergent` alone),
    quantile (`q` of histogram `metric`),
    samples (observations in histogram `metric`), cpu (canary CPU utilisation), custom (a user query).
    """

    key: str
    kind: str
    side: str = CANARY
    status: str | None = None
    metric: str | None = None
    q: float | None = None
    window: float = 60.0
    promql: str = ""


@dataclass(slots=True, frozen=True)
class Context:
    """The rollout facts queries are filled with."""

    namespace: str
    canary: str
    stable: str
    patch_name: str = ""
    patch_version: str = ""


def template_vars(template: str) -> list[str]:
    return _VAR.findall(template)


def unknown_vars(template: str) -> list[str]:
    return [v for v in template_vars(template) if v not in TEMPLATE_VARS]


def is_comparison(template: str) -> bool:
    """A query that compares canary with stable: meaningless once no stable pod is left."""
    return "stableRevision" in template_vars(template)


def fill_args(template: str, args: dict[str, str]) -> str:
    """`{{args.NAME}}` replaced by the argument's value (a template's parameters)."""
    def sub(m: re.Match) -> str:
        if m.group(1) not in args:
            raise KeyError(f"argument {m.group(1)!r} has no value (give it in spec.analysis.args)")
        return args[m.group(1)]
    return _ARG.sub(sub, template)


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


def _sel(ctx: Context, side: str, **extra: str) -> str:
    labels = {"namespace": ctx.namespace, "revision": ctx.canary if side == CANARY else ctx.stable, **extra}
    return "{" + ",".join(f'{k}="{_quote(v)}"' for k, v in labels.items()) + "}"


# A comparison counts a request its client gave up on (`abandoned`) as failed: a patch that hangs
# requests makes clients time out, and a hung request never reaches `error`. Clients also hang up
# for their own reasons (a user stops a chat), but they do so on both sides alike, so the difference
# stays honest. Absolute checks count `error` alone: hang-ups would be background noise there.
FAILED = "failed"
FAILED_STATUSES = ("error", "abandoned")


def count_query(ctx: Context, side: str, window: float, status: str | None = None) -> str:
    """Requests of `side` over `window`: all, one `status`, or `failed` (any of FAILED_STATUSES)."""
    selector = _sel(ctx, side, **({"status": status} if status and status != FAILED else {}))
    if status == FAILED:
        selector = selector[:-1] + f',status=~"{"|".join(FAILED_STATUSES)}"}}'
    return f"sum(increase({REQUESTS}{selector}[{promql_duration(window)}]))"


def shadow_query(ctx: Context, window: float, result: str) -> str:
    """The canary's shadow comparisons over `window`: all `compared` (agree or divergent), or `divergent`."""
    selector = _sel(ctx, CANARY)[:-1]
    selector += f',result="{DIVERGENT}"}}' if result == DIVERGENT else f',result=~"{"|".join(COMPARED_RESULTS)}"}}'
    return f"sum(increase({SHADOW}{selector}[{promql_duration(window)}]))"


def quantile_query(ctx: Context, side: str, metric: str, q: float, window: float) -> str:
    """The median over pods of each pod's quantile: a uniform regression moves it, one noisy pod
    (a neighbour, a slow node) does not. `>= 0` drops pods with no samples (NaN)."""
    return (f"quantile(0.5, histogram_quantile({q:g}, sum by (le, instance) (rate({metric}_bucket"
            f"{_sel(ctx, side)}[{promql_duration(window)}]))) >= 0)")


def samples_query(ctx: Context, side: str, metric: str, window: float) -> str:
    return f"sum(increase({metric}_count{_sel(ctx, side)}[{promql_duration(window)}]))"


def cpu_query(ctx: Context, window: float) -> str:
    ns = f'namespace="{_quote(ctx.namespace)}"'
    return (f"avg(rate(process_cpu_seconds_total{{{ns}}}[{promql_duration(window)}])"
            f" / on(namespace, instance) graft_cpu_quota_cores{{{ns}}}"
            f" and on(namespace, instance) (graft_engine_revision_info{_sel(ctx, CANARY)} == 1))")


def plan(check, ctx: Context, window: float) -> list[Series]:
    """The numbers `check` (a spec Check) needs over `window` seconds, each with its PromQL."""
    kind = check.kind
    if kind == "rate" and check.metric == "output-divergence":
        return [Series(f"canary_{result}", "shadow", CANARY, result, metric=SHADOW, window=window,
                       promql=shadow_query(ctx, window, result)) for result in (COMPARED, DIVERGENT)]
    if kind == "rate":
        status = "ok" if check.metric == "success-rate" else "error"
        return [Series("canary_requests", "count", CANARY, None, window=window,
                       promql=count_query(ctx, CANARY, window)),
                Series("canary_matching", "count", CANARY, status, window=window,
                       promql=count_query(ctx, CANARY, window, status))]
    if kind == "difference":
        return [Series(f"{side}_{what}", "count", side, status, window=window,
                       promql=count_query(ctx, side, window, status))
                for side in (CANARY, STABLE) for what, status in (("requests", None), ("errors", FAILED))]
    if kind == "quantile":
        metric, q = QUANTILES[check.metric]
        sides = (CANARY, STABLE) if check.max_ratio is not None else (CANARY,)
        out = []
        for side in sides:
            out.append(Series(f"{side}_quantile", "quantile", side, metric=metric, q=q, window=window,
                              promql=quantile_query(ctx, side, metric, q, window)))
            out.append(Series(f"{side}_samples", "samples", side, metric=metric, window=window,
                              promql=samples_query(ctx, side, metric, window)))
        return out
    if kind == "utilisation":
        return [Series("value", "cpu", CANARY, window=window, promql=cpu_query(ctx, window))]
    variables = {"namespace": ctx.namespace, "canaryRevision": ctx.canary, "stableRevision": ctx.stable,
                 "window": promql_duration(window), "patchName": ctx.patch_name,
                 "patchVersion": ctx.patch_version}
    out = [Series("value", "custom", CANARY, window=window, promql=render(check.query, variables))]
    if check.min_samples is not None:
        out.append(Series("canary_requests", "count", CANARY, window=window,
                          promql=count_query(ctx, CANARY, window)))
    return out
