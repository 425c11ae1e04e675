"""Replacing an applied patch by another version of it: one swap, never a step without either.

A real `graft serve` with the test patches: `kv-align@3.2.2-test` gives the same values as the
built-in `kv-align@3.2.1` by another path, `kv-align@3.2.2-skew` wrong ones (its self-check fails).
"""
from __future__ import annotations

import asyncio
import json
import textwrap
import threading

import httpx
import pytest

from graft.engine.patches.bundle import digest_of
from tests.support import metric_value, start_engine, wait_for_metric

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
OLD, NEW, SKEW = "3.2.1", "3.2.2-test", "3.2.2-skew"
PROMPTS = ("The capital of France is", "def fibonacci(n):\n   ",
           "Q: A train leaves at 3 pm and travels for 2 hours. When does it arrive?\nA:")
MAX_TOKENS = 6
SWAPS = 6


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("replace"), "--enable-test-patches", "--allow-unsigned-bundles")
    yield eng
    eng.stop()


@pytest.fixture(autouse=True)
def nothing_applied(engine):
    """Each test starts and ends on the base revision."""
    yield
    with engine.admin() as admin:
        for applied in admin.get("/admin/patches").json()["applied"]:
            admin.delete(f"/admin/patches/{applied['name']}")


def post(eng, version: str, name: str = "kv-align", **extra) -> httpx.Response:
    with eng.admin() as admin:
        return admin.post("/admin/patches", json={"name": name, "version": version, "source": {"builtin": True},
                                                  **extra})


def applied(eng) -> tuple[str, list[tuple[str, str]]]:
    with eng.admin() as admin:
        listing = admin.get("/admin/patches").json()
    return listing["revision"], [(a["name"], a["version"]) for a in listing["applied"]]


def greedy(eng, prompt: str) -> str:
    r = httpx.post(eng.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def metrics(eng) -> str:
    return httpx.get(eng.metrics_url + "/metrics", timeout=10).text


def series(text: str, metric: str, **labels: str) -> list[str]:
    """The sample lines of `metric` carrying `labels`."""
    return [line for line in text.splitlines() if line.startswith(metric + "{")
            and all(f'{k}="{v}"' in line for k, v in labels.items())]


class StreamingLoad:
    """A few clients streaming greedy completions of known prompts until stopped, in their own thread."""

    def __init__(self, eng, clients: int = 3):
        self.eng, self.clients = eng, clients
        self.answers: list[tuple[str, int, str, int]] = []   # (prompt, status, text, completion tokens)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()))

    def __enter__(self) -> "StreamingLoad":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.eng.url, timeout=120) as client:
            await asyncio.gather(*(self._client(client, c) for c in range(self.clients)))

    async def _client(self, client: httpx.AsyncClient, c: int) -> None:
        i = c
        while not self._stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            try:
                self.answers.append((prompt, *await self._stream(client, body)))
            except httpx.HTTPError as exc:   # a dropped stream is a failed request too
                self.answers.append((prompt, 0, repr(exc), 0))
            i += 1

    @staticmethod
    async def _stream(client: httpx.AsyncClient, body: dict) -> tuple[int, str, int]:
        """(status, text, completion tokens) of one streamed completion; an error event shows in the text."""
        text, tokens = "", 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    text += f"<error: {event['error']['message']}>"
                for choice in event.get("choices", []):
                    text += choice["text"]
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return r.status_code, text, tokens


def test_replacing_back_and_forth_under_streaming_load_fails_no_request(engine):
    assert post(engine, OLD).status_code == 200
    reference = {p: greedy(engine, p) for p in PROMPTS}
    metrics(engine)   # base's series are shown one last time, then dropped
    assert not series(metrics(engine), "graft_requests_total", revision="base")
    replaced = metric_value(metrics(engine), "graft_patch_apply_seconds_count", op="replace")
    with StreamingLoad(engine) as load:
        for cycle in range(SWAPS):
            version = (NEW, OLD)[cycle % 2]
            r = post(engine, version, replace=True)
            assert r.status_code == 200, r.text
            assert r.json()["changed"] is True and r.json()["revision"] == f"kv-align@{version}"
            assert applied(engine) == (f"kv-align@{version}", [("kv-align", version)])
            text = metrics(engine)
            assert not series(text, "graft_requests_total", revision="base"), "a step ran without either version"
            assert [line.split('version="')[1].split('"')[0] for line in
                    series(text, "graft_patch_info", name="kv-align")] == [version]
            assert series(text, "graft_engine_revision_info") == \
                [f'graft_engine_revision_info{{revision="kv-align@{version}"}} 1.0']
            done = metric_value(text, "graft_requests_total", revision=f"kv-align@{version}", status="ok")
            wait_for_metric(engine, "graft_requests_total", lambda v: v > done, timeout=60,
                            revision=f"kv-align@{version}", status="ok")
    text = metrics(engine)
    assert not series(text, "graft_requests_total", revision="base")
    assert metric_value(text, "graft_patch_apply_seconds_count", op="replace") == replaced + SWAPS
    assert len(load.answers) >= SWAPS
    wrong = [a for a in load.answers if a[1:] != (200, reference[a[0]], MAX_TOKENS)]
    assert not wrong, f"{len(wrong)} of {len(load.answers)} answers differ from the greedy reference: {wrong[:3]}"


def test_a_replace_that_fails_its_self_check_keeps_the_applied_version(engine):
    assert post(engine, OLD).status_code == 200
    reference = greedy(engine, PROMPTS[0])
    before = metrics(engine)
    r = post(engine, SKEW, replace=True)
    assert r.status_code == 422, r.text
    message = r.json()["error"]["message"]
    assert "self-check" in message and f"kv-align@{OLD} stays applied" in message
    assert applied(engine) == (f"kv-align@{OLD}", [("kv-align", OLD)])
    assert greedy(engine, PROMPTS[0]) == reference
    text = metrics(engine)
    assert metric_value(text, "graft_patch_info", name="kv-align", version=OLD) == 1
    assert not series(text, "graft_patch_info", version=SKEW)
    assert metric_value(text, "graft_engine_revision_info", revision=f"kv-align@{OLD}") == 1
    assert not series(text, "graft_requests_total", revision=f"kv-align@{SKEW}")
    for op in ("replace", "revert"):
        assert metric_value(text, "graft_patch_apply_seconds_count", op=op) == \
            metric_value(before, "graft_patch_apply_seconds_count", op=op)
    assert metric_value(text, "graft_patch_failures_total", name="kv-align", reason="verify") == \
        metric_value(before, "graft_patch_failures_total", name="kv-align", reason="verify") + 1


def test_a_replace_whose_migrate_raises_keeps_the_applied_version(engine):
    source = textwrap.dedent("""
        from graft.engine import attention
        from graft.engine.patches.base import Patch

        def migrate(engine):
            raise RuntimeError("no room for the new layout")

        def patches():
            return [Patch("kv-align", "3.3.0", {"kv.gather": attention.gather_aligned}, migrate=migrate)]
    """)
    assert post(engine, OLD).status_code == 200
    with engine.admin() as admin:
        r = admin.post("/admin/patches", json={"name": "kv-align", "version": "3.3.0", "replace": True,
                                               "source": {"module": source, "digest": digest_of(source)}})
    assert r.status_code == 422, r.text
    assert "migrate() failed" in r.json()["error"]["message"]
    assert "no room for the new layout" in r.json()["error"]["message"]
    assert applied(engine) == (f"kv-align@{OLD}", [("kv-align", OLD)])
    assert greedy(engine, PROMPTS[0])


def test_another_version_without_replace_answers_409_naming_replace(engine):
    assert post(engine, OLD).status_code == 200
    r = post(engine, NEW)
    assert r.status_code == 409, r.text
    assert '"replace": true' in r.json()["error"]["message"]
    assert applied(engine) == (f"kv-align@{OLD}", [("kv-align", OLD)])


def test_replace_with_nothing_applied_applies_and_the_same_version_changes_nothing(engine):
    r = post(engine, NEW, replace=True)
    assert r.status_code == 200, r.text
    assert r.json()["changed"] is True and r.json()["revision"] == f"kv-align@{NEW}"
    assert metric_value(metrics(engine), "graft_patch_info", name="kv-align", version=NEW) == 1
    again = post(engine, NEW, replace=True)
    assert again.status_code == 200 and again.json()["changed"] is False
    assert applied(engine) == (f"kv-align@{NEW}", [("kv-align", NEW)])


def test_replace_still_refuses_a_patch_overlapping_another(engine):
    # fault and slow both replace request.outcome: only a version of the same name is replaced
    assert post(engine, "1", name="fault", config={"errorRate": 0}).status_code == 200
    r = post(engine, "1", name="slow", replace=True)
    assert r.status_code == 409, r.text
    assert "request.outcome" in r.json()["error"]["message"]
    assert applied(engine) == ("fault@1", [("fault", "1")])


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_replace_must_be_a_boolean(engine, value):
    r = post(engine, NEW, replace=value)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("replace:")


def test_the_listing_always_names_the_revision_its_patches_make(engine):
    """GET /admin/patches reads one snapshot the step loop publishes: while versions are swapped back
    and forth, every listing's revision is exactly its applied patches, never one from either side."""
    swaps = 4

    def swap() -> None:
        for i in range(swaps):
            assert post(engine, NEW if i % 2 == 0 else OLD, replace=True).status_code == 200

    swapper = threading.Thread(target=swap)
    swapper.start()
    seen, listings = set(), 0
    with engine.admin() as admin:
        while swapper.is_alive() or not listings:
            listing = admin.get("/admin/patches").json()
            names = ",".join(sorted(f"{a['name']}@{a['version']}" for a in listing["applied"])) or "base"
            assert listing["revision"] == names
            seen.add(names)
            listings += 1
    swapper.join()
    assert {f"kv-align@{OLD}", f"kv-align@{NEW}"} <= seen, f"{listings} listings saw the swaps happen"


def config_digest_of(eng, name: str) -> str:
    with eng.admin() as admin:
        listing = admin.get("/admin/patches").json()
    return next(a["configDigest"] for a in listing["applied"] if a["name"] == name)


def test_another_config_of_an_applied_patch_is_a_replace_never_dropped(engine):
    """The same name@version with another config is not the same patch: without `replace` it is a
    409 (it used to be answered `changed: false`, the new config dropped), with `replace` it is
    swapped in, and the listing's config digest says which config runs."""
    from graft.api import config_digest

    calm, noisy = {"errorRate": 0.0}, {"errorRate": 0.5}
    assert post(engine, "1", name="fault", config=calm).status_code == 200
    assert config_digest_of(engine, "fault") == config_digest(calm)
    again = post(engine, "1", name="fault", config={"errorRate": 0.0})
    assert again.status_code == 200 and again.json()["changed"] is False
    refused = post(engine, "1", name="fault", config=noisy)
    assert refused.status_code == 409 and "another config" in refused.text, refused.text
    assert config_digest_of(engine, "fault") == config_digest(calm)
    swapped = post(engine, "1", name="fault", config=noisy, replace=True)
    assert swapped.status_code == 200 and swapped.json()["changed"] is True, swapped.text
    assert config_digest_of(engine, "fault") == config_digest(noisy)
    assert applied(engine) == ("fault@1", [("fault", "1")])
