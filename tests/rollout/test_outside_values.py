"""Numbers from outside (Prometheus, a custom check's query) never reach a status they cannot live in.

Whatever a provider answers for each series of each check of the default analysis (any float,
NaN and both infinities included, or no data), judging it gives a CheckResult whose stored form is
JSON without NaN or Inf (what the API server takes), and an infinite value makes that check an
Error naming the series, never a verdict: +Inf / +Inf is no latency ratio of 1, +Inf requests no
error rate.
"""
from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from graft.rollout import analysis
from graft.rollout.observation import Measurement
from graft.rollout.status import AnalysisStatus, CheckResult, RolloutStatus

from rollout_fleet import make_spec

SPEC = make_spec(analysis_breakers=[
    {"name": "error-rate", "max": 0.01},
    {"name": "ttft-p99", "maxRatio": 1.5},
    {"name": "tpot-p99", "maxRatio": 1.3},
    {"name": "cpu", "max": 0.9},
    {"name": "output-divergence", "max": 0.05, "consecutive": 1},
    {"name": "inf-check", "max": 1, "query": "vector(1)/0"},
], analysis_gates=[{"name": "error-rate-delta", "max": 0.01}])
PLAN = analysis.plan_run(SPEC, RolloutStatus(), "llm", 1000.0)

numbers = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([math.inf, -math.inf, math.nan, 0.0, 1.0, 1e300]))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_answer_gives_a_storable_result_and_infinity_an_error(data):
    results = []
    for check, series in PLAN:
        values = {s.key: data.draw(numbers, label=f"{check.key} {s.key}") for s in series}
        result = analysis.judge(check, Measurement(check.key, values), SPEC.analysis, previous=None, stable_pods=True)
        stored = json.dumps(result.to_dict(), allow_nan=False)          # raises on NaN or Inf
        assert CheckResult.from_dict(json.loads(stored)).verdict == result.verdict
        infinite = [k for k, v in values.items() if v is not None and math.isinf(v)]
        if infinite:
            assert result.verdict == analysis.ERROR and infinite[0] in result.message, (values, result.message)
        results.append(result)
    json.dumps(AnalysisStatus(verdict=analysis.verdict_of(SPEC.analysis, results), results=results).to_dict(),
               allow_nan=False)


def test_a_ratio_of_two_infinities_is_an_error_not_a_pass():
    (check, series), = [(c, s) for c, s in PLAN if c.name == "tpot-p99"]
    m = Measurement(check.key, {s.key: math.inf for s in series})
    result = analysis.judge(check, m, SPEC.analysis, previous=None, stable_pods=True)
    assert result.verdict == analysis.ERROR and "not a finite number" in result.message


def test_nan_reads_as_no_data_and_a_non_number_as_an_error():
    m = Measurement("breaker/x", {"a": math.nan, "b": 2.0})
    assert m.values == {"a": None, "b": 2.0} and m.error is None
    bad = Measurement("breaker/x", {"a": "7"})
    assert bad.error == "a is '7', not a number"
