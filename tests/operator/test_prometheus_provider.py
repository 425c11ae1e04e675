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


# which Prometheus a rollout may name, and when its Secrets are read

from graft.operator.problems import PrometheusRefused, SecretError                # noqa: E402
from graft.operator.prometheus import address_allowed                            # noqa: E402
from graft.operator.runtime import Runtime                                       # noqa: E402
from graft.operator.settings import OperatorSettings                             # noqa: E402
from graft.rollout.spec import PrometheusSource                                   # noqa: E402

PREFIXES = ["http://prometheus.monitoring:9090", "https://prom.obs:9443/org"]


@pytest.mark.parametrize("address,ok", [
    ("http://prometheus.monitoring:9090", True),
    ("http://prometheus.monitoring:9090/", True),
    ("HTTP://Prometheus.Monitoring:9090/api", True),
    ("https://prom.obs:9443/org", True),
    ("https://prom.obs:9443/org/team-a", True),
    ("https://prom.obs:9443/organisation", False),       # a path prefix is whole segments
    ("https://prom.obs/org", False),                     # another port (443)
    ("http://prom.obs:9443/org", False),                 # another scheme
    ("http://prometheus.monitoring", False),
    ("http://prometheus.monitoring:9090@127.0.0.1:8000", False),   # credentials hide the real host
    ("http://prometheus.monitoring:9090.evil.example", False),
    ("https://prom.obs:9443/org/../admin", False),
    ("https://prom.obs:9443/org/%2e%2e/admin", False),
    ("http://prometheus.monitoring:9090/?x=1", False),
    ("http://127.0.0.1:9090", False),
])
def test_an_address_is_allowed_under_a_prefix_only(address, ok):
    assert address_allowed(address, PREFIXES) is ok


def test_settings_read_the_allowed_addresses_and_refuse_a_bad_one():
    tls = {"GRAFT_ADMIN_CA_FILE": "/ca.pem"}
    s = OperatorSettings.from_env({**tls, "GRAFT_PROMETHEUS_ALLOWED": " https://prom.obs:9443/org ,",
                                   "GRAFT_PROMETHEUS_SECRET_NAMESPACES": "team-a, team-b"})
    assert s.prometheus_prefixes == ["http://prometheus.monitoring:9090", "https://prom.obs:9443/org"]
    assert s.prometheus_secret_namespaces == ["team-a", "team-b"]
    assert OperatorSettings.from_env(tls).prometheus_secret_namespaces == [], "no Secret is read by default"
    with pytest.raises(ValueError, match="GRAFT_PROMETHEUS_ALLOWED"):
        OperatorSettings.from_env({**tls, "GRAFT_PROMETHEUS_ALLOWED": "prom.obs:9443"})


class RecordingKube:
    def __init__(self):
        self.gets = []

    async def get(self, path):
        self.gets.append(path)
        return {"data": {"token": "c2VjcmV0"}}

    async def aclose(self):
        pass


@pytest.mark.parametrize("source,namespaces,reason", [
    (PrometheusSource("http://127.0.0.1:1", ("tok", "token")), ["team-a"], "PrometheusNotAllowed"),
    (PrometheusSource("", ("tok", "token")), [], "PrometheusSecretsNotAllowed"),
    (PrometheusSource("", None, ("ca", "ca.crt")), ["team-b"], "PrometheusSecretsNotAllowed"),
])
async def test_a_refused_source_reads_no_secret(source, namespaces, reason):
    runtime = Runtime(OperatorSettings(prometheus_secret_namespaces=namespaces))
    runtime.kube = RecordingKube()
    with pytest.raises(PrometheusRefused) as info:
        await runtime.provider(source, "team-a")
    assert info.value.problem.reason == reason and info.value.problem.permanent
    assert runtime.kube.gets == []
    assert runtime._providers == {}, "nothing was built to connect with"


async def test_secrets_are_read_where_the_administrator_allows_it():
    runtime = Runtime(OperatorSettings(prometheus_secret_namespaces=["team-a"]))
    runtime.kube = RecordingKube()
    provider = await runtime.provider(PrometheusSource("", ("tok", "token")), "team-a")
    assert runtime.kube.gets == ["/api/v1/namespaces/team-a/secrets/tok"]
    assert provider._client.headers["Authorization"] == "Bearer secret"
    await runtime.close()


async def test_a_forbidden_secret_is_a_missing_one_with_the_reason():
    from graft.operator.kube import KubeError

    class Forbidden(RecordingKube):
        async def get(self, path):
            raise KubeError(403, "secrets is forbidden")
    runtime = Runtime(OperatorSettings(prometheus_secret_namespaces=["team-a"]))
    runtime.kube = Forbidden()
    with pytest.raises(SecretError, match="may not read Secret team-a/tok"):
        await runtime.provider(PrometheusSource("", ("tok", "token")), "team-a")
