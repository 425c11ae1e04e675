"""Fixtures of the end-to-end scenarios: one fleet for the module, steady client traffic over it,
and a clean slate (no rollout, every engine at `base`) before each scenario.

Everything runs in the module's event loop: the local API server emulator, the pod runner and the
client traffic live in it, so they keep going while a scenario awaits.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from graft.bench.data import bbh_prompts
from graft.demo import DEMO_TASKS
from tests.e2e.fleet import ClientLoad, Fleet, open_fleet
from tests.support import data_dir

RATE = 1.0          # client requests per second over the whole fleet
MAX_TOKENS = 4      # the prompts are long (a 3-shot BBH prefix, ~800 tokens): answers stay short
PER_TASK = 2        # 2 examples of 3 tasks: with 3 pods, each pod sees the same 2 prompts (prefix cache)
WARM_TIMEOUT = 240  # seconds for a fresh fleet to serve its first, cold, prefills


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Fleet]:
    async with open_fleet(tmp_path_factory.mktemp("devcluster")) as f:
        yield f


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def traffic(fleet: Fleet) -> AsyncIterator[ClientLoad]:
    prompts = [p.text for p in bbh_prompts(data_dir(), tasks=DEMO_TASKS, per_task=PER_TASK)]
    async with fleet.traffic(prompts, RATE, MAX_TOKENS) as t:
        yield ClientLoad(t)


@pytest_asyncio.fixture(loop_scope="module", autouse=True)
async def clean_slate(fleet: Fleet, traffic: ClientLoad) -> AsyncIterator[None]:
    """Each scenario starts with no rollout, every engine at `base`, and a fleet that keeps up
    with the traffic (the first prefill of each prompt on a pod is cold: seconds on a CPU); it
    leaves no rollout and every engine at `base` behind (a real cluster stays as it was)."""
    await fleet.reset()

    async def keeps_up() -> bool:
        return traffic.keeps_up([p["metadata"]["name"] for p in await fleet.ready_pods()])
    await fleet.wait_for(keeps_up, WARM_TIMEOUT, "every pod to keep up with the client traffic")
    traffic.warm_at = time.time()
    yield
    await fleet.reset()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item):
    """A failed scenario's report carries the rollout's status and Events, and the log tails."""
    report = yield
    fleet = item.funcargs.get("fleet") if hasattr(item, "funcargs") else None
    if report.when == "call" and report.failed and isinstance(fleet, Fleet):
        try:
            # the module's loop is idle between a test's call and its teardown
            text = fleet.loop.run_until_complete(asyncio.wait_for(fleet.diagnostics(list(fleet.rollouts)), 30))
        except Exception as e:  # a report must never fail for want of diagnostics
            text = f"(no diagnostics: {type(e).__name__}: {e})"
        report.sections.append(("e2e diagnostics", text))
    return report
