"""`graft dashboard` in a real headless Chromium, against the API server emulator, fake engines,
real Prometheus and the real operator: the page lists a rollout and follows it through its steps
as they happen (server-sent events, never a reload), a promote click (confirmed) approves a manual
step, an abort click rolls the rollout back. A screenshot of each state is kept under the test's
folder (tmp_path/screenshots), named in the assertions' messages."""
import asyncio

import pytest

from graft.devcluster.kubeconfig import write_kubeconfig
from graft.operator.kube import rollout_path

from browser import Browser, need_chromium, start_dashboard
from operator_cluster import CHECKS, create, events_of, get_rollout, manifest, until

pytestmark = pytest.mark.timeout(240)

# approval at 50% and again at 67%: one click promotes the first, one aborts at the second
STEPS = [{"weight": 1, "pause": "1s"}, {"weight": 50, "untilApproved": True}, {"weight": 67, "pause": {}},
         {"weight": 100}]
# the usual checks, and a dry-run TTFT ratio: canary against stable latency, which the page charts apart
ANALYSIS = {**CHECKS, "breakers": CHECKS["breakers"] + [{"name": "ttft-p99", "maxRatio": 1.5, "window": "4s",
                                                          "dryRun": True}]}
ROW = "document.getElementById('row-PatchRollout-kv-align')"
DETAIL = "document.getElementById('detail')"


def awaiting_at(step: int) -> str:
    """JS: the page shows the rollout waiting for approval at `step` (counted from 1)."""
    return (f"const d = {DETAIL}; const li = document.querySelector('#ladder li[data-state=current]');"
            f"return d && !d.hidden && li && li.dataset.index === '{step}' && d.dataset.phase === 'Progressing'"
            " && document.getElementById('detail-message').textContent.includes('waiting for approval')"
            " && !!document.querySelector('#actions button[data-action=promote]')")


async def test_the_dashboard_follows_a_rollout_live_and_promotes_and_aborts_it(cluster, namespace, fleet, operator,
                                                                              prometheus, tmp_path):
    need_chromium()
    engines = await fleet(3)
    await operator()
    kubeconfig = str(write_kubeconfig(tmp_path / "kubeconfig", cluster.url, namespace=namespace))
    proc, url = await start_dashboard(kubeconfig, namespace, tmp_path / "dashboard.log")
    browser = await asyncio.to_thread(Browser, tmp_path / "screenshots")
    page = lambda f, *a: asyncio.to_thread(f, *a)       # noqa: E731 - every browser call off this loop
    try:
        await page(browser.open, url)
        await page(browser.wait_js, "return document.getElementById('connection').dataset.state === 'live'", 20,
                   "the event stream")
        # a mark that a reload would wipe, and every phase/step the list row shows, as it shows them
        await page(browser.js, """
            window.graftNoReload = true; window.graftSeen = [];
            const note = () => { const r = document.getElementById('row-PatchRollout-kv-align');
              if (!r) return; const s = `${r.dataset.phase}:${r.dataset.step}`;
              if (window.graftSeen[window.graftSeen.length - 1] !== s) window.graftSeen.push(s); };
            new MutationObserver(note).observe(document.body, {subtree: true, childList: true, attributes: true});""")

        # created after the page loaded: it appears, and moves, without a reload
        await create(cluster, namespace, manifest(prometheus, steps=STEPS, analysis=ANALYSIS))
        await page(browser.wait_js, f"return !!{ROW}", 20, "the rollout's row")
        await page(browser.click, "#row-PatchRollout-kv-align")
        await page(browser.wait_js, awaiting_at(2), 90, "step 2 waiting for approval")
        await page(browser.wait_js, "return document.querySelectorAll('.chart canvas').length >= 3", 20,
                   "a chart per check")
        shot = await page(browser.screenshot, "1-waiting-at-step-2")
        ladder = await page(browser.js, "return [...document.querySelectorAll('#ladder li')].map("
                                        "li => [li.dataset.state, li.querySelector('.spent').textContent])")
        assert [s for s, _ in ladder] == ["done", "current", "next", "next"], (ladder, shot)
        assert ladder[0][1].endswith("s") and ladder[0][1] != "-", ladder    # the time spent on step 1
        checks = await page(browser.js, "return [...document.querySelectorAll('.chart')].map(c => c.dataset.check)")
        assert {"breaker/error-rate", "breaker/latency-p99", "gate/error-rate-delta", "breaker/ttft-p99"} \
            <= set(checks), checks
        await page(browser.wait_js, "return !!document.querySelector('#latency .chart[data-check=\"breaker/ttft-p99\"]"
                                    " canvas')", 20, "the canary vs stable latency chart")
        canaries = sum(e.revision != "base" for e in engines)

        # promote: a dialog first; Cancel changes nothing
        await page(browser.click, "#actions button[data-action=promote]")
        await page(browser.wait_js, "return document.getElementById('confirm').open", 5, "the confirmation dialog")
        await page(browser.screenshot, "2-confirm-promote")
        await page(browser.click, "#confirm-cancel")
        await asyncio.sleep(1.0)
        obj = await get_rollout(cluster.kube, namespace, "kv-align")
        assert "graft.dev/promote" not in (obj["metadata"].get("annotations") or {}), "cancelled, yet promoted"
        assert obj["status"]["stepIndex"] == 1

        await page(browser.click, "#actions button[data-action=promote]")
        await page(browser.wait_js, "return document.getElementById('confirm').open", 5, "the confirmation dialog")
        await page(browser.click, "#confirm-ok")
        await page(browser.wait_js, "const t = document.getElementById('toast'); return !t.hidden && "
                                    "t.textContent.includes('promotion of the current step requested')", 20,
                   "the CLI's answer to promote")
        await page(browser.wait_js, awaiting_at(3), 90, "step 3 waiting for approval after the promotion")
        shot = await page(browser.screenshot, "3-promoted-to-step-3")
        obj = await get_rollout(cluster.kube, namespace, "kv-align")
        assert obj["status"]["stepIndex"] == 2 and obj["status"]["reason"] == "AwaitingApproval", (obj["status"], shot)
        assert sum(e.revision != "base" for e in engines) == obj["status"]["canaryPods"] > canaries

        # abort: confirmed, the rollout rolls back and the page says so
        await page(browser.click, "#actions button[data-action=abort]")
        await page(browser.wait_js, "return document.getElementById('confirm').open", 5, "the confirmation dialog")
        await page(browser.screenshot, "4-confirm-abort")
        await page(browser.click, "#confirm-ok")
        await page(browser.wait_js, f"return {DETAIL}.dataset.phase === 'RolledBack' && "
                                    f"{ROW}.dataset.phase === 'RolledBack' && "
                                    "!!document.querySelector('#actions button[data-action=retry]')", 90, "RolledBack")
        await until(lambda: all(e.revision == "base" for e in engines), 30, what="every engine back on base")
        # the operator posts its Events after the status: they arrive on the page as they are posted
        await page(browser.wait_js, "return !!document.querySelector('#events tr[data-reason=RolledBack]')", 20,
                   "the RolledBack Event on the page")
        shot = await page(browser.screenshot, "5-rolled-back")
        reasons = await page(browser.js, "return [...document.querySelectorAll('#events tr[data-reason]')]"
                                         ".map(r => r.dataset.reason)")
        posted = [e["reason"] for e in await events_of(cluster.kube, namespace, "kv-align")]
        assert {"Approved", "Aborted", "RolledBack"} <= set(reasons), f"{reasons} (posted: {posted}; {shot})"
        assert set(reasons) == set(posted), f"{reasons} (posted: {posted})"

        # all of it live: the same document throughout, the row seen at every step on the way
        assert await page(browser.js, "return window.graftNoReload === true"), "the page reloaded"
        seen = await page(browser.js, "return window.graftSeen")
        steps_seen = [int(s.split(":")[1]) for s in seen if s.startswith("Progressing:")]
        assert steps_seen == sorted(steps_seen) and {1, 2, 3} <= set(steps_seen), seen
        assert seen[-1] == "RolledBack:3", seen
        assert (await get_rollout(cluster.kube, namespace, "kv-align"))["status"]["phase"] == "RolledBack"
    finally:
        await page(browser.quit)
        proc.terminate()
        await proc.wait()
