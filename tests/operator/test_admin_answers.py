"""An engine's admin answer of the wrong shape is a per-pod AdminError, never a crash of the reconciliation.

`GET /admin/patches` answering `{}`, a list, a number for the revision or a revision that is no list
of `name@version` (and the same for an apply or a revert) comes back as AdminError of kind
BAD_ANSWER naming what the engine said: not a permanent refusal (the rollout does not fail on it),
tried again next tick like an engine that did not answer.
"""
from __future__ import annotations

import httpx
import pytest

from graft.operator.admin import AdminClient, AdminError
from graft.rollout.observation import BAD_ANSWER, PERMANENT_ERRORS


def client(body) -> AdminClient:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=body)
    return AdminClient("t", retries=0, transport=httpx.MockTransport(handler))


@pytest.mark.parametrize("body, needle", [
    ({}, "an object without a string revision (None)"),
    ([], "a JSON list"),
    ("base", "a JSON str"),
    ({"revision": 7}, "an object without a string revision (7)"),
    ({"revision": ["kv-align@3.2.1"]}, "without a string revision"),
    ({"revision": "kv-align"}, "'kv-align' is not of the form name@version"),
    ({"revision": "kv-align@3.2.1,../../etc@1"}, "is not of the form name@version"),
])
async def test_every_call_refuses_an_answer_without_a_valid_revision(body, needle):
    admin = client(body)
    try:
        for call in (admin.revision("10.0.0.1", 8081),
                     admin.apply("10.0.0.1", 8081, "kv-align", "3.2.1", {"builtin": True}),
                     admin.revert("10.0.0.1", 8081, "kv-align")):
            with pytest.raises(AdminError) as info:
                await call
            assert info.value.kind == BAD_ANSWER and needle in info.value.message, info.value.message
            assert info.value.kind not in PERMANENT_ERRORS
    finally:
        await admin.aclose()


async def test_a_valid_revision_is_returned_as_the_engine_said_it():
    admin = client({"revision": "kv-align@3.2.1,prefill-fusion@3.2.1", "applied": []})
    try:
        assert await admin.revision("10.0.0.1", 8081) == "kv-align@3.2.1,prefill-fusion@3.2.1"
        assert await client({"revision": "base"}).revision("10.0.0.1", 8081) == "base"
    finally:
        await admin.aclose()
