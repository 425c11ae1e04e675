"""The Prometheus provider's errors: each failure has its kind, and only those are caught."""
import httpx
import pytest

from graft.operator.prometheus import HTTP, NON_FINITE, PARSE, QUERY, TRANSPORT, PrometheusProvider, ProviderError


def provider(answer) -> PrometheusProvider:
    def handler(request: httpx.Request) -> httpx.Response:
        return answer(request) if callable(answer) else answer
    return PrometheusProvider("http://prom:9090", 1.0, transport=httpx.MockTransport(handler))


def vector(*values) -> httpx.Response:
    return httpx.Response(200, json={"status": "success", "data": {
        "resultType": "vector", "result": [{"metric": {}, "value": [0, v]} for v in values]}})


def refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


async def test_one_number_or_none():
    assert await provider(vector("0.25")).query("up") == 0.25
    assert await provider(vector()).query("up") is None
    assert await provider(vector("NaN")).query("up") is None


@pytest.mark.parametrize("answer,kind,needle", [
    (refused, TRANSPORT, "unreachable: ConnectError"),
    (httpx.Response(403), HTTP, "refused the credentials (HTTP 403)"),
    (httpx.Response(502, text="bad gateway"), HTTP, "answered HTTP 502 without JSON"),
    (httpx.Response(400, json={"status": "error", "errorType": "bad_data", "error": "parse error"}),
     QUERY, "bad_data: parse error"),
    (vector("1", "2"), PARSE, "returned 2 series"),
    (vector("high"), PARSE, "'high', not a number"),
    (httpx.Response(200, json=["not", "an", "object"]), PARSE, "a JSON list"),
    (httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": [{}]}}),
     PARSE, "vector result is malformed"),
    (httpx.Response(200, json={"status": "success", "data": {"resultType": "scalar", "result": None}}),
     PARSE, "scalar result is malformed"),
    (httpx.Response(200, json={"status": "success", "data": "nothing"}), PARSE, "not an object"),
    (vector("+Inf"), NON_FINITE, "'+Inf', not a finite number"),
    (vector("-Inf"), NON_FINITE, "'-Inf', not a finite number"),
    (httpx.Response(200, json={"status": "success", "data": {"resultType": "scalar", "result": [0, "+Inf"]}}),
     NON_FINITE, "not a finite number"),
])
async def test_every_failure_is_a_provider_error_with_its_kind(answer, kind, needle):
    with pytest.raises(ProviderError) as info:
        await provider(answer).query("up")
    assert info.value.kind == kind and needle in str(info.value)


async def test_a_failed_query_makes_its_check_an_error_not_a_crash():
    class Check:
        key = "breaker/error-rate"

    class Series:
        key, promql = "canary", "up"

    (measurement,) = await provider(vector("1", "2")).measure([(Check(), [Series()])])
    assert measurement.check == "breaker/error-rate" and "returned 2 series" in measurement.error


async def test_a_bug_is_not_swallowed_as_a_provider_error():
    def broken(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("a bug in the transport")
    with pytest.raises(RuntimeError):
        await provider(broken).query("up")
