"""Bundle code can fail, hang or try to exit: the engine answers 422 and keeps serving.

Each test runs against a real `graft serve` process, started with a trusted key and a short
`--bundle-timeout`, and sends signed bundles the way the operator does.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import psutil
import pytest

from graft.engine.patches.bundle import digest_of, sign
from tests.support import ROOT, start_engine

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
TIMEOUT = 3.0   # the engines' --bundle-timeout


@pytest.fixture(scope="module")
def key(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("keys") / "release"
    subprocess.run([sys.executable, "-m", "graft.cli", "patch", "keygen", str(prefix)], check=True, cwd=ROOT,
                   capture_output=True)
    return prefix


def engine_args(key) -> list[str]:
    return ["--trusted-key", f"{key}.pub", "--bundle-timeout", str(TIMEOUT)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, key):
    eng = start_engine(tmp_path_factory.mktemp("contained"), *engine_args(key))
    yield eng
    eng.stop()


def bundle(body: str, name: str = "demo", version: str = "1.0.0", slot: str = "attention.gather_aligned",
           point: str = "kv.gather") -> str:
    """A bundle providing `name@version` (one slot), with `body` run at import."""
    return textwrap.dedent("""
        from graft.engine import attention
        from graft.engine.patches.base import Patch
        {body}
        def patches():
            return [Patch({name!r}, {version!r}, {{{point!r}: {slot}}})]
    """).format(body=textwrap.dedent(body), name=name, version=version, slot=slot, point=point)


def request(source: str, key, name: str = "demo", version: str = "1.0.0") -> dict:
    digest = digest_of(source)
    return {"name": name, "version": version,
            "source": {"module": source, "digest": digest,
                       "signature": sign(name, version, digest, (key.parent / f"{key.name}.key").read_bytes())}}


def post(eng, body: dict, timeout: float = 60) -> httpx.Response:
    with eng.admin() as admin:
        return admin.post("/admin/patches", json=body, timeout=timeout)


def revision(eng) -> str:
    with eng.admin() as admin:
        return admin.get("/admin/patches").json()["revision"]


def completion(eng, n: int = 2) -> int:
    r = httpx.post(eng.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": n},
                   timeout=60)
    return r.status_code


def health_latencies(eng, stop: threading.Event) -> list[float]:
    """Seconds each GET /health took (None for one that failed), polled until `stop` is set."""
    out: list[float] = []
    with httpx.Client(timeout=10) as client:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                ok = client.get(eng.url + "/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            out.append(time.monotonic() - t0 if ok else float("inf"))
            time.sleep(0.05)
    return out


def in_background(fn):
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn()))
    thread.start()
    return thread, result


def test_a_bundle_that_raises_system_exit_is_422_and_cuts_no_stream(engine, key):
    lines: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", engine.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "Count slowly:", "max_tokens": 48, "ignore_eos": True,
                "stream": True}) as r:
            lines.extend(ln for ln in r.iter_lines() if ln)
    streaming = threading.Thread(target=stream)
    streaming.start()
    time.sleep(0.3)
    r = post(engine, request(bundle("raise SystemExit(3)"), key))
    streaming.join(120)
    assert r.status_code == 422, r.text
    assert "SystemExit" in r.json()["error"]["message"]
    assert engine.proc.poll() is None
    assert lines[-1] == "data: [DONE]" and len([ln for ln in lines if ln.startswith("data: {")]) >= 48
    assert revision(engine) == "base" and completion(engine) == 200


def test_a_bundle_that_ends_its_process_at_import_is_422_and_the_engine_lives_on(engine, key):
    r = post(engine, request(bundle("import os\nos._exit(7)", name="exits"), key, name="exits"))
    assert r.status_code == 422 and "exit code 7" in r.json()["error"]["message"], r.text
    assert engine.proc.poll() is None
    assert revision(engine) == "base" and completion(engine) == 200


def test_a_spinning_bundle_leaves_no_thread_spinning_in_the_engine(engine, key):
    r = post(engine, request(bundle("while True:\n    pass", name="spinner"), key, name="spinner"))
    assert r.status_code == 422, r.text
    proc = psutil.Process(engine.proc.pid)
    time.sleep(0.5)
    before = sum(proc.cpu_times()[:2])
    time.sleep(2)
    assert sum(proc.cpu_times()[:2]) - before < 1.0     # an idle engine, not a core kept busy
    assert completion(engine) == 200


def test_the_check_runs_the_bundle_as_the_engine_will_without_its_secrets(engine, key, tmp_path):
    runs = tmp_path / "runs"
    source = bundle(f"""
        import json, os
        with open({str(runs)!r}, "a") as f:
            f.write(json.dumps([__name__, __file__, os.environ.get("GRAFT_ADMIN_TOKEN")]) + "\\n")
    """, name="recorder")
    r = post(engine, request(source, key, name="recorder"))
    assert r.status_code == 200, r.text
    try:
        checked, loaded = (json.loads(line) for line in runs.read_text().splitlines())
        assert checked[:2] == loaded[:2] and digest_of(source) in loaded[1]
        assert checked[2] is None and loaded[2] == engine.token
    finally:
        with engine.admin() as admin:
            admin.delete("/admin/patches/recorder")


def test_a_patch_whose_probe_raises_is_reverted_and_answers_422(engine, key):
    source = bundle("""
        def broken(q, k, v, scale):
            raise RuntimeError("prefill is broken")
    """, slot="broken", point="attention.prefill")
    r = post(engine, request(source, key))
    assert r.status_code == 422, r.text
    assert "prefill is broken" in r.json()["error"]["message"]
    assert revision(engine) == "base"
    assert completion(engine) == 200


def test_health_answers_while_a_slow_bundle_imports(engine, key):
    source = bundle("import time\ntime.sleep(1)", name="sleepy")
    stop = threading.Event()
    poller, latencies = in_background(lambda: health_latencies(engine, stop))
    time.sleep(0.2)
    r = post(engine, request(source, key, name="sleepy"))
    stop.set()
    poller.join()
    assert r.status_code == 200, r.text
    try:
        assert len(latencies["value"]) >= 10 and max(latencies["value"]) < 0.5, latencies["value"]
    finally:
        with engine.admin() as admin:
            assert admin.delete("/admin/patches/sleepy").status_code == 200


def test_a_bundle_that_never_finishes_loading_is_422_and_the_engine_keeps_serving(engine, key):
    stop = threading.Event()
    poller, latencies = in_background(lambda: health_latencies(engine, stop))
    t0 = time.monotonic()
    r = post(engine, request(bundle("while True:\n    pass", name="spin"), key, name="spin"))
    took = time.monotonic() - t0
    served = completion(engine)
    stop.set()
    poller.join()
    assert r.status_code == 422, r.text
    assert f"{TIMEOUT:g}" in r.json()["error"]["message"]
    assert TIMEOUT <= took < TIMEOUT + 30
    assert served == 200 and max(latencies["value"]) < 0.5, latencies["value"]
    assert revision(engine) == "base"


def test_a_bundle_that_only_overruns_inside_the_engine_is_refused_at_the_same_deadline(engine, key):
    source = bundle("""
        import os, time
        if os.environ.get("GRAFT_ADMIN_TOKEN"):   # the engine's secret: never in the check's environment
            time.sleep(30)
    """, name="sly")
    t0 = time.monotonic()
    r = post(engine, request(source, key, name="sly"))
    assert r.status_code == 422 and "did not finish" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 20
    assert revision(engine) == "base" and completion(engine) == 200


def test_reapplying_an_applied_bundle_runs_none_of_its_code(engine, key, tmp_path):
    runs = tmp_path / "runs"
    source = bundle(f"""
        with open({str(runs)!r}, "a") as f:
            f.write("x")
    """, name="counted")
    body = request(source, key, name="counted")
    first = post(engine, body)
    assert first.status_code == 200 and first.json()["changed"] is True, first.text
    try:
        ran = runs.read_text()
        again = post(engine, body)
        assert again.status_code == 200 and again.json()["changed"] is False
        assert runs.read_text() == ran
    finally:
        with engine.admin() as admin:
            admin.delete("/admin/patches/counted")


@pytest.mark.parametrize("field,value", [("name", "nl\n"), ("version", "1.0.0\n")])
def test_a_trailing_newline_is_400(engine, key, field, value):
    body = request(bundle("", name="nl"), key, name="nl")
    body[field] = value
    r = post(engine, body)
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    assert revision(engine) == "base"


def test_a_digest_with_a_trailing_newline_is_400(engine, key):
    body = request(bundle("", name="nl"), key, name="nl")
    body["source"]["digest"] += "\n"
    r = post(engine, body)
    assert r.status_code == 400 and "digest" in r.json()["error"]["message"], r.text
    with engine.admin() as admin:
        assert admin.delete("/admin/patches/nl%0A").status_code == 400


def test_sigterm_ends_the_engine_while_a_bundle_spins(tmp_path, key):
    eng = start_engine(tmp_path, *engine_args(key), "--bundle-timeout", "60", "--grace", "2")
    try:
        posting, _ = in_background(lambda: post(eng, request(bundle("while True:\n    pass", name="spin"), key,
                                                             name="spin"), timeout=90).status_code)
        time.sleep(2.5)   # the bundle is loading now
        children = psutil.Process(eng.proc.pid).children(recursive=True)
        eng.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        code = eng.proc.wait(30)
        assert time.monotonic() - t0 < 15
        assert code == 0, eng.log()
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive
        posting.join(30)
    finally:
        eng.stop(signal.SIGKILL)


def delete(eng, name: str) -> tuple[int, float]:
    """DELETE /admin/patches/NAME: its status and how long it took to answer."""
    t0 = time.monotonic()
    with eng.admin() as admin:
        code = admin.delete(f"/admin/patches/{name}", timeout=60).status_code
    return code, time.monotonic() - t0


def test_a_revert_answers_at_once_while_a_slow_bundle_loads(engine, key):
    """A rollback's DELETE must not queue behind another apply's bundle load (which once made it
    miss the operator's call timeout): the revert runs at the next step, the load carries on."""
    with engine.admin() as admin:
        assert admin.post("/admin/patches", json={"name": "kv-align", "version": "3.2.1",
                                                  "source": {"builtin": True}}).status_code == 200
    slow = bundle("import time\ntime.sleep(2.5)", name="slow", slot="attention.decode_attention_fast",
                  point="attention.decode")
    posting, answer = in_background(lambda: post(engine, request(slow, key, name="slow")))
    try:
        time.sleep(0.5)                     # the bundle is importing now
        code, took = delete(engine, "kv-align")
        assert code == 200 and took < 1.5, (code, took)
        assert "kv-align" not in revision(engine)
        posting.join(60)
        assert answer["value"].status_code == 200, answer["value"].text   # its self-check ran again on base
        assert revision(engine) == "slow@1.0.0"
    finally:
        posting.join(60)
        delete(engine, "slow")
        delete(engine, "kv-align")


def test_a_revert_of_a_patch_still_being_applied_calls_the_apply_off(engine, key):
    """The operator's POST timed out and it reverted: the apply, when its load ends, must not put
    back what the revert took out."""
    slow = bundle("import time\ntime.sleep(2.5)", name="late")
    posting, answer = in_background(lambda: post(engine, request(slow, key, name="late")))
    try:
        time.sleep(0.5)
        code, took = delete(engine, "late")
        assert code == 404 and took < 1.5, (code, took)     # not applied yet: the operator counts it reverted
        posting.join(60)
        r = answer["value"]
        assert r.status_code == 409 and "was reverted while late@1.0.0 was being applied" in r.text, r.text
        assert revision(engine) == "base"
        assert completion(engine) == 200
        # asked again afterwards, it applies (the bundle is loaded once, kept by its digest)
        assert post(engine, request(slow, key, name="late")).status_code == 200
        assert revision(engine) == "late@1.0.0"
    finally:
        posting.join(60)
        delete(engine, "late")
