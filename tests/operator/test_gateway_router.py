"""The Gateway API router on its own, against an API server played by a MockTransport: the weight it
reads from an HTTPRoute's rules, what it writes back, and how it reports what it cannot do."""
import json

import httpx
import pytest

from graft.operator.kube import Kube
from graft.operator.routers import RouteError, router_for
from graft.operator.routers.gatewayapi import GatewayAPIRouter
from graft.operator.routers.podratio import PodRatioRouter
from graft.rollout.spec import TrafficRouting

ROUTING = TrafficRouting("gatewayAPI", "llm", "llm-stable", "llm-canary")
PATH = "/apis/gateway.networking.k8s.io/v1/namespaces/ns/httproutes/llm"


class FakeApi:
    """GET answers the route (404 when there is none); PATCH is recorded and answered `patch_status`."""

    def __init__(self, route: dict | None, patch_status: int = 200):
        self.route, self.patch_status, self.patches = route, patch_status, []

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.method == "PATCH":
            self.patches.append(json.loads(request.content))
            if self.patch_status != 200:
                return httpx.Response(self.patch_status, json={"message": "the object has been modified"})
            return httpx.Response(200, json={})
        if request.url.path != PATH or self.route is None:
            return httpx.Response(404, json={"message": "not found"})
        return httpx.Response(200, json=self.route)

    def router(self) -> GatewayAPIRouter:
        return GatewayAPIRouter(Kube("http://api", transport=httpx.MockTransport(self.handler)), "ns", ROUTING)


def route(*rules: list[dict]) -> dict:
    return {"metadata": {"resourceVersion": "7"}, "spec": {"rules": [{"backendRefs": refs} for refs in rules]}}


def refs(stable: int | None, canary: int | None, **extra) -> list[dict]:
    out = [{"name": "llm-stable", **({} if stable is None else {"weight": stable})},
           {"name": "llm-canary", **({} if canary is None else {"weight": canary})}]
    return [{**r, **extra} for r in out]


@pytest.mark.parametrize("rules,weight", [
    ([refs(100, 0)], 0), ([refs(90, 10)], 10), ([refs(0, 100)], 100), ([refs(0, 0)], 0),
    ([refs(3, 1)], 25), ([refs(1, 2)], 67),
    ([refs(None, None)], 50),                          # no weight: 1 each, as Gateway API defaults it
    ([refs(80, 20), refs(95, 5)], 20),                 # rules that disagree: the highest share
    ([refs(100, 0), [{"name": "other", "weight": 9}]], 0),   # a rule naming neither Service counts for nothing
])
async def test_the_weight_is_the_canary_share_of_the_rules_naming_both_services(rules, weight):
    assert await FakeApi(route(*rules)).router().get_weight() == weight


async def test_backend_refs_of_another_kind_are_not_the_services():
    api = FakeApi(route(refs(90, 10, kind="ServiceImport")))
    with pytest.raises(RouteError) as info:
        await api.router().get_weight()
    assert info.value.reason == "BackendRefsMissing"
    assert info.value.message == ("HTTPRoute ns/llm has no rule with backendRefs to both Service llm-stable "
                                  "and Service llm-canary")


async def test_setting_a_weight_writes_every_rule_naming_both_and_nothing_else():
    api = FakeApi(route(refs(100, 0), refs(100, 0), [{"name": "other", "weight": 4}]))
    await api.router().set_weight(30)
    (body,) = api.patches
    assert body["metadata"] == {"resourceVersion": "7"}
    assert [[r["weight"] for r in rule["backendRefs"]] for rule in body["spec"]["rules"]] == [[70, 30], [70, 30], [4]]
    assert api.route["spec"]["rules"][0]["backendRefs"][0]["weight"] == 100, "the route read is not changed in place"


@pytest.mark.parametrize("weight", [0, 100])
async def test_the_ends_of_the_range_are_weights_too(weight):
    api = FakeApi(route(refs(50, 50)))
    await api.router().set_weight(weight)
    assert [r["weight"] for r in api.patches[0]["spec"]["rules"][0]["backendRefs"]] == [100 - weight, weight]


@pytest.mark.parametrize("weight", [-1, 101])
async def test_a_weight_out_of_range_is_refused_before_any_call(weight):
    api = FakeApi(route(refs(100, 0)))
    with pytest.raises(ValueError, match="0..100"):
        await api.router().set_weight(weight)
    assert api.patches == []


async def test_a_refused_update_is_reported_as_http_route_update_failed():
    api = FakeApi(route(refs(100, 0)), patch_status=409)
    with pytest.raises(RouteError) as info:
        await api.router().set_weight(10)
    assert info.value.reason == "HTTPRouteUpdateFailed"
    assert info.value.message == "HTTPRoute ns/llm: the object has been modified"


async def test_a_missing_route_is_reported_on_set_and_get():
    for call in (lambda r: r.set_weight(5), lambda r: r.get_weight()):
        with pytest.raises(RouteError) as info:
            await call(FakeApi(None).router())
        assert (info.value.reason, info.value.message) == ("HTTPRouteMissing", "HTTPRoute ns/llm not found")


async def test_finalize_sends_everything_to_stable_and_tolerates_only_a_missing_route():
    api = FakeApi(route(refs(60, 40)))
    await api.router().finalize()
    assert [r["weight"] for r in api.patches[0]["spec"]["rules"][0]["backendRefs"]] == [100, 0]
    await FakeApi(None).router().finalize()            # the route is gone: nothing to send back
    with pytest.raises(RouteError) as info:
        await FakeApi(route(refs(60, 40)), patch_status=409).router().finalize()
    assert info.value.reason == "HTTPRouteUpdateFailed"
    with pytest.raises(RouteError) as info:
        await FakeApi(route([{"name": "other"}])).router().finalize()
    assert info.value.reason == "BackendRefsMissing"


async def test_the_routing_kind_picks_the_router():
    kube = Kube("http://api", transport=httpx.MockTransport(FakeApi(None).handler))
    assert isinstance(router_for(ROUTING, kube, "ns"), GatewayAPIRouter)
    plain = router_for(TrafficRouting("podRatio", "", "", ""), kube, "ns")
    assert isinstance(plain, PodRatioRouter)
    assert await plain.get_weight() is None, "pod ratio: the share of canary pods is the weight"
    await plain.set_weight(50)
    await plain.finalize()


def test_a_route_error_reads_as_its_message():
    e = RouteError("HTTPRouteMissing", "HTTPRoute ns/llm not found")
    assert str(e) == "HTTPRoute ns/llm not found" and (e.reason, e.message) == ("HTTPRouteMissing", str(e))
