"""What a rollout's queries may read: its own namespace only, and template arguments that stay label values."""
import pytest
from hypothesis import given, settings, strategies as st

from graft.rollout import queries
from graft.rollout.queries import QueryError, arg_problem, fill_args, unscoped_selectors, vector_selectors
from graft.rollout.spec import SpecError, parse_spec

MINIMAL = {"selector": {"matchLabels": {"app": "llm-engine"}},
           "patch": {"name": "kv-align", "version": "3.2.1"}}
NS = 'namespace="{{namespace}}"'


def errors_of(spec, templates=None) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse_spec(spec, templates)
    return {e.path: e.message for e in info.value.errors}


def with_query(query, **analysis):
    return {**MINIMAL, "analysis": {"breakers": [{"name": "q", "max": 1, "query": query}], **analysis}}


# every vector selector of a rollout's own query reads its namespace

@pytest.mark.parametrize("query", [
    f"max(up{{{NS}}})",
    f'histogram_quantile(0.99, sum by (le) (rate(x_bucket{{{NS}, revision="{{{{canaryRevision}}}}"}}[{{{{window}}}}])))',
    f"a{{{NS}}} / on (instance) group_left (revision) b{{{NS}}}",
    f"sum(x{{{NS}}}) without (pod) > bool 0.5",
    f'label_replace(x{{{NS}}}, "dst", "$1", "src", "(.*)") offset 5m',
    f"rate(x{{{NS}}}[5m:1m] @ end()) # a comment with y{{}}",
    f'{{__name__="up", {NS}}}',
    "vector(1) / 0",
])
def test_a_scoped_query_is_accepted(query):
    assert unscoped_selectors(query) == []
    assert parse_spec(with_query(query)).analysis.breakers[0].query == query


@pytest.mark.parametrize("query,unscoped", [
    ("max(up)", ["up"]),
    ("sum by (le) (rate(x_bucket[5m]))", ["x_bucket"]),
    (f"a{{{NS}}} or b", ["b"]),
    ('{__name__=~".+"}', ['{__name__=~".+"}']),
    ('x{namespace=~"{{namespace}}"}', ["x"]),
    ('x{namespace!="{{namespace}}"}', ["x"]),
    ('x{namespace="kube-system"}', ["x"]),
    (f'x{{{NS}}} unless on() y{{namespace="other"}}', ["y"]),
])
def test_an_unscoped_query_is_refused_naming_the_selectors(query, unscoped):
    assert unscoped_selectors(query) == unscoped
    message = errors_of(with_query(query))["spec.analysis.breakers[0].query"]
    assert 'must carry namespace="{{namespace}}"' in message and unscoped[0] in message


@pytest.mark.parametrize("query", ["x{a=}", "x{", "rate(x[5m)", "x}", "x{namespace}", "x ; y"])
def test_a_query_the_check_cannot_read_is_refused(query):
    with pytest.raises(QueryError):
        vector_selectors(query)
    assert "spec.analysis.breakers[0].query" in errors_of(with_query(query))


def template(query):
    return {"args": [{"name": "job", "value": "engine"}], "breakers": [{"name": "kv", "max": 1, "query": query}]}


def test_a_cluster_template_is_trusted_and_a_namespaced_one_is_not():
    query = 'max(x{job="{{args.job}}"})'
    cluster = {**MINIMAL, "analysis": {"templates": [{"name": "t", "clusterScope": True}]}}
    (check,) = parse_spec(cluster, {("t", True): template(query)}).analysis.breakers
    assert check.query == 'max(x{job="engine"})'
    namespaced = {**MINIMAL, "analysis": {"templates": [{"name": "t"}]}}
    message = errors_of(namespaced, {("t", False): template(query)})["PatchAnalysisTemplate t: spec.breakers[0].query"]
    assert "missing in: x" in message


# template arguments: a label value, escaped, and nothing else

INJECTION = 'x"} or vector(0) #'


def test_an_argument_cannot_rewrite_the_query():
    query = f'max(x{{{NS},job="{{{{args.job}}}}"}})'
    filled = fill_args(query, {"job": INJECTION})
    assert filled == f'max(x{{{NS},job="x\\"}} or vector(0) #"}})'
    assert vector_selectors(filled) == [("x", [("namespace", "=", "{{namespace}}"), ("job", "=", INJECTION)])]
    spec = {**MINIMAL, "analysis": {"templates": [{"name": "t", "clusterScope": True}],
                                    "args": [{"name": "job", "value": INJECTION}]}}
    (check,) = parse_spec(spec, {("t", True): template(query)}).analysis.breakers
    assert check.query == filled
    variables = {"namespace": "llm", "canaryRevision": "a", "stableRevision": "b", "window": "1m",
                 "patchName": "p", "patchVersion": "1"}
    rendered = queries.render(check.query, variables)
    assert vector_selectors(rendered) == [("x", [("namespace", "=", "llm"), ("job", "=", INJECTION)])]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_any_argument_value_stays_one_label_value(value):
    query = f'sum(rate(x{{{NS},job="{{{{args.job}}}}",t="y"}}[5m])) / sum(z{{{NS}}})'
    if arg_problem(value) is not None:
        with pytest.raises(ValueError):
            fill_args(query, {"job": value})
        return
    selectors = vector_selectors(fill_args(query, {"job": value}))
    assert selectors == [("x", [("namespace", "=", "{{namespace}}"), ("job", "=", value), ("t", "=", "y")]),
                         ("z", [("namespace", "=", "{{namespace}}")])]


@pytest.mark.parametrize("query", ['x{job={{args.job}}}', "x{job='{{args.job}}'}", "x{job=`{{args.job}}`}",
                                   'topk({{args.job}}, x)', 'x # "{{args.job}}"'])
def test_an_argument_outside_a_double_quoted_string_refuses_the_template(query):
    spec = {**MINIMAL, "analysis": {"templates": [{"name": "t", "clusterScope": True}]}}
    message = errors_of(spec, {("t", True): template(query)})["ClusterPatchAnalysisTemplate t: spec.breakers[0].query"]
    assert "{{args.job}} may only stand inside a double-quoted string" in message


@pytest.mark.parametrize("value,problem", [("a\nb", "control characters"), ("a\x00", "control characters"),
                                           ("a" * 257, "at most 256"), ("{{namespace}}", "{{")])
def test_a_bad_argument_value_is_refused_naming_it(value, problem):
    spec = {**MINIMAL, "analysis": {"templates": [{"name": "t", "clusterScope": True}],
                                    "args": [{"name": "job", "value": value}]}}
    assert problem in errors_of(spec, {("t", True): template('x{job="{{args.job}}"}')})["spec.analysis.args[0].value"]
