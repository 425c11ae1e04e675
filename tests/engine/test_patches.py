"""Hot patches on a live engine: swaps under load, the self-check, start-up patches, metrics."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tests.support import metric_value, start_engine

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
BUILTIN = {"builtin": True}
SET_321 = ("kv-align", "prefill-fusion", "sync-free")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("patched"), "--enable-test-patches", "--kv-cache-memory", "128M")
    yield eng
    eng.stop()


def greedy(url: str, prompt: str, n: int = 24) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": n,
                                                  "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def apply(eng, name: str, version: str = "3.2.1", **extra) -> httpx.Response:
    with eng.admin() as admin:
        return admin.post("/admin/patches", json={"name": name, "version": version, "source": BUILTIN, **extra})


def revert(eng, name: str) -> httpx.Response:
    with eng.admin() as admin:
        return admin.delete(f"/admin/patches/{name}")


def revision(eng) -> str:
    with eng.admin() as admin:
        return admin.get("/admin/patches").json()["revision"]


PROMPT = "Q: Alice has 3 apples and buys 4 more. How many apples does she have?\nA: Let's think step by step."


@pytest.mark.parametrize("name", SET_321)
def test_each_321_patch_keeps_greedy_outputs_and_moves_the_revision(engine, name):
    before = greedy(engine.url, PROMPT)
    r = apply(engine, name)
    assert r.status_code == 200, r.text
    assert r.json()["revision"] == f"{name}@3.2.1"
    assert r.json()["applyMs"] >= 0
    try:
        assert greedy(engine.url, PROMPT) == before
        text = httpx.get(engine.metrics_url + "/metrics").text
        assert metric_value(text, "graft_patch_info", name=name, version="3.2.1") == 1
        assert metric_value(text, "graft_requests_total", revision=f"{name}@3.2.1") >= 1
    finally:
        assert revert(engine, name).json()["revision"] == "base"
    text = httpx.get(engine.metrics_url + "/metrics").text
    assert f'graft_patch_info{{digest="builtin",name="{name}"' not in text
    assert greedy(engine.url, PROMPT) == before


def test_the_whole_set_applies_together_and_lists_itself(engine):
    for name in SET_321:
        assert apply(engine, name).status_code == 200
    try:
        with engine.admin() as admin:
            listing = admin.get("/admin/patches").json()
        assert listing["revision"] == "kv-align@3.2.1,prefill-fusion@3.2.1,sync-free@3.2.1"
        assert [a["name"] for a in listing["applied"]] == sorted(SET_321)
        assert {"kv-align", "fault", "skew"} <= {a["name"] for a in listing["available"]}
        assert apply(engine, "kv-align").json()["changed"] is False  # idempotent
    finally:
        for name in SET_321:
            revert(engine, name)
    assert revision(engine) == "base"


def test_a_numerically_wrong_patch_is_refused_and_reverted(engine):
    before = greedy(engine.url, PROMPT)
    r = apply(engine, "skew", "1")
    assert r.status_code == 422
    assert "self-check" in r.json()["error"]["message"]
    assert revision(engine) == "base"
    assert greedy(engine.url, PROMPT) == before


def test_fault_patch_injects_errors_into_the_canary_revision(engine):
    assert apply(engine, "fault", "1", config={"errorRate": 0.5}).status_code == 200
    try:
        codes = [httpx.post(engine.url + "/v1/completions", json={"model": MODEL, "prompt": f"n{i}",
                            "max_tokens": 1}, timeout=60).status_code for i in range(30)]
    finally:
        revert(engine, "fault")
    assert codes.count(500) >= 5 and codes.count(200) >= 5, codes
    text = httpx.get(engine.metrics_url + "/metrics").text
    assert metric_value(text, "graft_requests_total", revision="fault@1", status="error") == codes.count(500)


LOAD_PROMPTS = [f"Worker {w}: count from {w} to ten." for w in range(6)]


async def _answers(url: str, prompts: list[str]) -> list[tuple[int, str]]:
    """Each prompt's greedy completion, all sent at once (as the load below sends them)."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        replies = await asyncio.gather(*(client.post("/v1/completions", json={
            "model": MODEL, "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}) for p in prompts))
    return [(r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text) for r in replies]


SWAP_CYCLES = 6    # apply then revert, each of the three 3.2.1 patches twice (a self-check each)


def test_swaps_under_load_fail_no_request_and_change_no_token(engine):
    """A half-applied patch would not fail a request, it would give wrong tokens: every answer during
    the swaps must be the greedy answer its prompt gets on some whole revision (base or a 3.2.1 patch)."""
    known: dict[str, set[str]] = {p: set() for p in LOAD_PROMPTS}
    for name in (None, *SET_321):
        if name is not None:
            assert apply(engine, name).status_code == 200
        try:
            for prompt, (code, text) in zip(LOAD_PROMPTS, asyncio.run(_answers(engine.url, LOAD_PROMPTS))):
                assert code == 200, text
                known[prompt].add(text)
        finally:
            if name is not None:
                revert(engine, name)
    stop = threading.Event()
    results: list[tuple[str, int, str]] = []

    def load() -> None:
        async def run() -> None:
            async with httpx.AsyncClient(base_url=engine.url, timeout=120) as client:
                async def worker(prompt: str) -> None:
                    while not stop.is_set():
                        r = await client.post("/v1/completions", json={
                            "model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
                        results.append((prompt, r.status_code,
                                        r.json()["choices"][0]["text"] if r.status_code == 200 else r.text))
                await asyncio.gather(*(worker(p) for p in LOAD_PROMPTS))
        asyncio.run(run())

    t = threading.Thread(target=load)
    t.start()
    try:
        with engine.admin() as admin:
            for cycle in range(SWAP_CYCLES):
                name = SET_321[cycle % 3]
                r = admin.post("/admin/patches", json={"name": name, "version": "3.2.1", "source": BUILTIN})
                assert r.status_code == 200, r.text
                assert admin.delete(f"/admin/patches/{name}").status_code == 200
    finally:
        stop.set()
        t.join(120)
    assert len(results) > 20
    codes = [code for _, code, _ in results]
    assert set(codes) == {200}, {c: codes.count(c) for c in set(codes)}
    wrong = [(prompt, text) for prompt, _, text in results if text not in known[prompt]]
    assert not wrong, f"{len(wrong)} of {len(results)} answers match no revision: {wrong[:3]}; known: {known}"
    text = httpx.get(engine.metrics_url + "/metrics").text
    assert metric_value(text, "graft_patch_apply_seconds_count", op="apply") >= SWAP_CYCLES


def test_an_engine_restarted_with_graft_patches_comes_back_patched(tmp_path):
    eng = start_engine(tmp_path, env={"GRAFT_PATCHES": "kv-align@3.2.1,sync-free@3.2.1"})
    try:
        assert revision(eng) == "kv-align@3.2.1,sync-free@3.2.1"
        text = httpx.get(eng.metrics_url + "/metrics").text
        assert metric_value(text, "graft_patch_info", name="sync-free") == 1
        assert metric_value(text, "graft_engine_revision_info", revision="kv-align@3.2.1,sync-free@3.2.1") == 1
    finally:
        eng.stop()
