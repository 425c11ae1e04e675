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

Prometheus answers the operator about every namespace, so what a rollout's own query may read is
checked (`unscoped_selectors`): every vector selector in a query written in a PatchRollout or a
PatchAnalysisTemplate must carry `namespace="{{namespace}}"`; a ClusterPatchAnalysisTemplate's
queries are the cluster administrator's and are trusted as written. A template argument is a
label value and nothing else (`fill_args`): it may stand only inside a double-quoted string, and
its value is escaped there, so no argument can change what a query means.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote as url_quote

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

    kind: count (requests of `side` with `status`, or all; `failed` is `error` or `timeout`,
    `answered` all but hang-ups),
    shadow (the canary's shadow comparisons: `compared`, agreeing or divergent, or `divergent` alone),
    quantile (`q` of histogram `metric`),
    samples (observations in histogram `metric`), cpu (canary CPU utilisation), custom (a user query),
    web (a number from an HTTP service: `web` is the request, its placeholders filled),
    job (a number from a Kubernetes Job: `job` is its spec, its placeholders filled).

    `provider` says who answers it: Prometheus (`promql`), the web provider (`web`) or the job
    provider (`job`).
    """

    key: str
    kind: str
    side: str = CANARY
    status: str | None = None
    metric: str | None = None
    q: float | None = None
    window: float = 60.0
    promql: str = ""
    web: Any = None          # a graft.rollout.spec.WebSpec with its placeholders filled
    job: Any = None          # a graft.rollout.spec.JobSpec with its placeholders filled

    @property
    def provider(self) -> str:
        return "web" if self.web is not None else "job" if self.job is not None else "prometheus"


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


MAX_ARG = 256     # characters of an argument's value


def arg_problem(value: str) -> str | None:
    """Why `value` cannot be a template argument (too long, a control character, a placeholder), or None."""
    if len(value) > MAX_ARG:
        return f"must be at most {MAX_ARG} characters"
    bad = next((c for c in value if ord(c) < 32 or 0x7f <= ord(c) < 0xa0), None)
    if bad is not None:
        return f"must not contain control characters (found {bad!r})"
    if "{{" in value or "}}" in value:
        return "must not contain {{ or }}"
    return None


def fill_args(template: str, args: dict[str, str]) -> str:
    """`{{args.NAME}}` replaced by the argument's value (a template's parameters), escaped as the
    content of a PromQL double-quoted string: the only place an argument may stand, so whatever
    its value, it stays one label value. KeyError: an argument without a value; ValueError: a
    placeholder outside a double-quoted string, or a value `arg_problem` refuses."""
    out, last = [], 0
    for m in _ARG.finditer(template):
        name = m.group(1)
        if _quoting(template, m.start()) != '"':
            raise ValueError(f"{{{{args.{name}}}}} may only stand inside a double-quoted string "
                             f'(a label value, e.g. job="{{{{args.{name}}}}}")')
        if name not in args:
            raise KeyError(f"argument {name!r} has no value (give it in spec.analysis.args)")
        problem = arg_problem(args[name])
        if problem is not None:
            raise ValueError(f"argument {name!r} {problem}")
        out += [template[last:m.start()], _quote(args[name])]
        last = m.end()
    return "".join(out) + template[last:]


def _quoting(text: str, at: int) -> str | None:
    """The string quote (`"`, `'` or a backtick) open at `text[at]`, `#` within a comment, or None."""
    open_, i = None, 0
    while i < at:
        c = text[i]
        if open_ is None:
            if c in "\"'`#":
                open_ = c
        elif open_ == "#":
            if c == "\n":
                open_ = None
        elif c == "\\" and open_ != "`":
            i += 1
        elif c == open_:
            open_ = None
        i += 1
    return open_


# PromQL, as far as telling vector selectors apart: the words that are no metric name
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
             "group_right", "atan2", "inf", "nan", "start", "end"}
_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_TOKEN = re.compile(r"""
    (?P<space>\s+) | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<number>(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\w*)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<matcher>=~|!~|!=|==|<=|>=|=)
  | (?P<punct>[{}()\[\],+\-*/%^<>@:])
""", re.VERBOSE | re.DOTALL)


class QueryError(ValueError):
    """A query the scope check cannot read."""


def _tokens(query: str) -> list[tuple[str, str]]:
    out, i = [], 0
    while i < len(query):
        m = _TOKEN.match(query, i)
        if m is None:
            raise QueryError(f"cannot read the query at character {i + 1} ({query[i:i + 20]!r})")
        if m.lastgroup not in ("space", "comment"):
            out.append((m.lastgroup, m.group()))
        i = m.end()
    return out


def _unquote(literal: str) -> str:
    if literal[0] == "`":
        return literal[1:-1]
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), literal[1:-1])


def vector_selectors(query: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """Each vector selector of `query` as (metric name or '', [(label, op, value)]); QueryError for
    a query it cannot read (unbalanced brackets, a character PromQL has not)."""
    toks, out, i = _tokens(query), [], 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else None
        if kind == "ident" and text.lower() in _LABEL_LISTS and nxt == "(":
            i = _skip(toks, i + 1, "(", ")")          # by (le, instance): label names, no selectors
            continue
        if text == "[":
            i = _skip(toks, i, "[", "]")              # a range or subquery's durations
            continue
        if kind == "ident" and (text.lower() in _KEYWORDS or nxt == "("
                                or (nxt or "").lower() in ("by", "without")):   # sum by (le) (...)
            i += 1                                    # an operator, a function or an aggregation
            continue
        if kind == "ident" or text == "{":
            name = text if kind == "ident" else ""
            if kind == "ident":
                i += 1
            matchers: list[tuple[str, str, str]] = []
            if i < len(toks) and toks[i][1] == "{":
                i, matchers = _matchers(toks, i + 1)
            out.append((name, matchers))
            continue
        if text in ("}", "]"):
            raise QueryError(f"unbalanced {text!r} in the query")
        i += 1
    return out


def _skip(toks: list[tuple[str, str]], i: int, left: str, right: str) -> int:
    depth = 0
    for j in range(i, len(toks)):
        depth += (toks[j][1] == left) - (toks[j][1] == right)
        if depth == 0:
            return j + 1
    raise QueryError(f"unbalanced {left!r} in the query")


def _matchers(toks: list[tuple[str, str]], i: int) -> tuple[int, list[tuple[str, str, str]]]:
    out = []
    while i < len(toks) and toks[i][1] != "}":
        kind, text = toks[i]
        if kind not in ("ident", "string"):
            raise QueryError(f"unexpected {text!r} in a label matcher")
        label = text if kind == "ident" else _unquote(text)
        if i + 2 < len(toks) and toks[i + 1][0] == "matcher" and toks[i + 2][0] == "string":
            out.append((label, toks[i + 1][1], _unquote(toks[i + 2][1])))
            i += 3
        elif kind == "string":                        # {"metric.name"}: the metric's name
            out.append(("__name__", "=", label))
            i += 1
        else:
            raise QueryError(f"label {label!r} has no matcher (label=\"value\")")
        if i < len(toks) and toks[i][1] == ",":
            i += 1
    if i >= len(toks):
        raise QueryError("unbalanced '{' in the query")
    return i + 1, out


_SCOPE = "\x00namespace\x00"     # stands for {{namespace}} while a query is checked: no real value is it


def unscoped_selectors(query: str) -> list[str]:
    """The vector selectors of a custom query (placeholders as written) that do not carry
    `namespace="{{namespace}}"`, as written in the message; QueryError when it cannot be read."""
    variables = {v: "x" for v in TEMPLATE_VARS} | {"namespace": _SCOPE, "window": "1m"}
    filled = _VAR.sub(lambda m: _SCOPE if m.group(1) == "namespace" else variables.get(m.group(1), "x"), query)
    out = []
    for name, matchers in vector_selectors(filled):
        if ("namespace", "=", _SCOPE) not in matchers:
            out.append(name or "{" + ",".join(f'{k}{op}"{v}"' for k, op, v in matchers) + "}")
    return out


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def render(template: str, variables: dict[str, str]) -> str:
    """Fill `{{name}}` placeholders; values are escaped for a PromQL string literal."""
    return _fill(template, variables, _quote)


def _sel(ctx: Context, side: str, **extra: str) -> str:
    labels = {"namespace": ctx.namespace, "revision": ctx.canary if side == CANARY else ctx.stable, **extra}
    return "{" + ",".join(f'{k}="{_quote(v)}"' for k, v in labels.items()) + "}"


# A request fails when the engine says so: `error`, or `timeout` (the engine ended it at the
# server's request timeout, so a patch that hangs requests fails them). A client that hangs up
# (`abandoned`, `cancelled`) is neither a failure nor an answer, in absolute checks and in the
# canary-vs-stable comparison alike: every rate is over the requests the engine answered
# (`answered`: every status but a hang-up). A client that could tell the canaries apart cannot
# tilt the judgement by hanging up on one side.
FAILED = "failed"
ANSWERED = "answered"
HANGUPS = ("abandoned", "cancelled")     # the client hung up before the answer was done
FAILED_STATUSES = ("error", "timeout")


def count_query(ctx: Context, side: str, window: float, status: str | None = None) -> str:
    """Requests of `side` over `window`: all, one `status`, `failed` (any of FAILED_STATUSES), or
    `answered` (all but HANGUPS)."""
    selector = _sel(ctx, side, **({"status": status} if status and status not in (FAILED, ANSWERED) else {}))
    if status == FAILED:
        selector = selector[:-1] + f',status=~"{"|".join(FAILED_STATUSES)}"}}'
    elif status == ANSWERED:
        selector = selector[:-1] + f',status!~"{"|".join(HANGUPS)}"}}'
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
        status = "ok" if check.metric == "success-rate" else FAILED
        return [Series("canary_requests", "count", CANARY, ANSWERED, window=window,
                       promql=count_query(ctx, CANARY, window, ANSWERED)),
                Series("canary_matching", "count", CANARY, status, window=window,
                       promql=count_query(ctx, CANARY, window, status))]
    if kind == "difference":
        return [Series(f"{side}_{what}", "count", side, status, window=window,
                       promql=count_query(ctx, side, window, status))
                for side in (CANARY, STABLE) for what, status in (("requests", ANSWERED), ("errors", FAILED))]
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
    if getattr(check, "web", None) is not None:
        return [Series("value", "web", CANARY, window=window, web=render_web(check.web, variables))]
    if getattr(check, "job", None) is not None:
        return [Series("value", "job", CANARY, window=window, job=render_job(check.job, variables))]
    out = [Series("value", "custom", CANARY, window=window, promql=render(check.query, variables))]
    if check.min_samples is not None:
        out.append(Series("canary_requests", "count", CANARY, window=window,
                          promql=count_query(ctx, CANARY, window)))
    return out


def _fill(template: str, variables: dict[str, str], escape) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name not in variables:
            raise KeyError(f"unknown template variable {{{{{name}}}}}")
        return escape(variables[name])
    return _VAR.sub(sub, template)


def fill_web_args(template: str, args: dict[str, str], escape) -> str:
    """`{{args.NAME}}` of a web check's URL or body filled, escaped by `escape`; KeyError names a missing one."""
    def sub(m: re.Match) -> str:
        if m.group(1) not in args:
            raise KeyError(f"no value for {{{{args.{m.group(1)}}}}}")
        return escape(args[m.group(1)])
    return _ARG.sub(sub, template)


def fill_strings(node: Any, fill) -> Any:
    """`node` (JSON: dicts, lists, scalars) with `fill` applied to every string in it, keys left as they are."""
    if isinstance(node, str):
        return fill(node)
    if isinstance(node, dict):
        return {k: fill_strings(v, fill) for k, v in node.items()}
    if isinstance(node, list):
        return [fill_strings(v, fill) for v in node]
    return node


def url_escape(value: str) -> str:
    return url_quote(value, safe="")


def json_escape(value: str) -> str:
    return json.dumps(value)[1:-1]


def render_web(web, variables: dict[str, str]):
    """A web check's request with its placeholders filled: URL-escaped in the URL, JSON-escaped in the body."""
    return replace(web, url=_fill(web.url, variables, url_escape),
                   body=None if web.body is None else _fill(web.body, variables, json_escape))


def render_job(job, variables: dict[str, str]):
    """A job check's spec with its placeholders filled in every string, as written (no escaping: each
    string stays one JSON string)."""
    spec = fill_strings(job.spec, lambda text: _fill(text, variables, str))
    return replace(job, spec_json=json.dumps(spec, sort_keys=True, separators=(",", ":")))
