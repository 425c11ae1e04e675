"""What a check's verdict says, word for word where the numbers are the point: each test here fails on
a deliberate break of graft/rollout/analysis.py or graft/rollout/stats.py that the rest of the suite
let through (a formatter returning nothing, a flipped bound, a dropped reset)."""
import pytest

from graft.rollout import analysis
from graft.rollout.observation import Measurement

from rollout_fleet import make_spec


def spec_with(**analysis_fields):
    return make_spec(**{f"analysis_{k}": v for k, v in analysis_fields.items()}).analysis


DELTA = spec_with(gates=[{"name": "error-rate-delta", "max": 0.001}], breakers=[])
FRAGMENTATION = spec_with(breakers=[], gates=[{"name": "kv-fragmentation", "max": 0.25, "window": "60s",
                                               "query": 'max(graft_kv_cache_fragmentation_ratio)'}])


def judge(a, values, **kw):
    (check,) = a.checks
    return analysis.judge(check, Measurement(check.key, values), a, previous=None, stable_pods=True, **kw)


def test_a_difference_is_said_in_percentage_points():
    r = judge(DELTA, {"canary_requests": 100_000, "canary_errors": 10, "stable_requests": 100_000,
                      "stable_errors": 10})
    assert r.verdict == "Successful"
    assert r.message.startswith("error-rate-delta: canary 10/100000 errors (0.01%) vs stable 10/100000 (0.01%) "
                                "over the step so far, difference +0 pp, Fisher p=")
    assert ": within +0.1 pp at 0.95 confidence (upper bound +0.0" in r.message and r.message.endswith(" pp)")


def test_a_custom_value_is_said_with_its_threshold():
    bad = judge(FRAGMENTATION, {"value": 0.3})
    assert (bad.verdict, bad.message) == ("Failed", "kv-fragmentation 0.3 over 60s breaches <= 0.25")
    good = judge(FRAGMENTATION, {"value": 0.123456})
    assert (good.verdict, good.message) == ("Successful", "kv-fragmentation 0.1235 over 60s within <= 0.25")
    assert good.numbers == {"measured": pytest.approx(0.123456)}
