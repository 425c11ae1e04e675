"""The operator's admin client against a real engine: another version goes in only by a replace it asks for."""
from __future__ import annotations

import pytest

from graft.operator.admin import AdminClient, AdminError
from graft.rollout.observation import VERIFY_FAILED
from tests.support import start_engine

pytestmark = pytest.mark.slow
BUILTIN = {"builtin": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("admin-client"), "--enable-test-patches")
    yield eng
    eng.stop()


async def test_apply_replaces_the_applied_version_only_when_asked(engine):
    client = AdminClient(engine.token, retries=0)
    where = (engine.host, engine.admin_port)
    try:
        assert await client.apply(*where, "kv-align", "3.2.1", BUILTIN) == "kv-align@3.2.1"
        with pytest.raises(AdminError) as refused:
            await client.apply(*where, "kv-align", "3.2.2-test", BUILTIN)
        assert refused.value.kind == "conflict" and '"replace": true' in refused.value.message
        assert await client.revision(*where) == "kv-align@3.2.1"

        assert await client.apply(*where, "kv-align", "3.2.2-test", BUILTIN, replace=True) == "kv-align@3.2.2-test"
        assert await client.apply(*where, "kv-align", "3.2.2-test", BUILTIN, replace=True) == "kv-align@3.2.2-test"

        with pytest.raises(AdminError) as failed:   # wrong values: the self-check keeps the applied version
            await client.apply(*where, "kv-align", "3.2.2-skew", BUILTIN, replace=True)
        assert failed.value.kind == VERIFY_FAILED and failed.value.status == 422
        assert await client.revision(*where) == "kv-align@3.2.2-test"
    finally:
        await client.aclose()
