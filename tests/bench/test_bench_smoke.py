"""The benchmark's own parts: load-generator statistics against a fake OpenAI SSE server, reports."""
from __future__ import annotations

import argparse
import asyncio
import json
import math

import pytest
from aiohttp import web

from graft.bench import report
from graft.bench.args import add_bench_args
from graft.bench.cli import main as bench_main
from graft.bench.data import bbh_prompts
from graft.bench.loadgen import LoadGenerator, Request, percentile
from graft.bench.patches import long_prompts
from graft.bench.throughput import workload_prompts
from tests.support import data_dir, free_port

FIRST_TOKEN_DELAY = 0.15
TOKEN_GAP = 0.03


class FakeOpenAI:
    """Streams `max_tokens` chunks: the first after FIRST_TOKEN_DELAY, then one every TOKEN_GAP.

    Prompt "fail" answers HTTP 500; "break" sends an error event mid-stream; "garbage" a non-JSON event.
    """

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []
        self.headers: list[dict[str, str]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        return app

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if prompt == "fail":
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(FIRST_TOKEN_DELAY)
            n = body["max_tokens"]
            for i in range(n):
                if i:
                    await asyncio.sleep(TOKEN_GAP)
                if prompt == "break" and i == 2:
                    await resp.write(b'data: {"error": {"message": "the step failed"}}\n\n')
                    break
                if prompt == "garbage" and i == 1:
                    await resp.write(b"data: {not json\n\n")
                    break
                piece = f"t{i} "
                choice = ({"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece})
                choice["finish_reason"] = "length" if i == n - 1 else None
                await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            else:
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n, "total_tokens": 0}
                await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1


@pytest.fixture
async def fake():
    server = FakeOpenAI()
    runner = web.AppRunner(server.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    server.url = f"http://127.0.0.1:{port}"
    yield server
    await runner.cleanup()


async def test_load_generator_measures_ttft_tpot_latency_and_tokens(fake):
    requests = [Request(f"prompt number {i}", max_tokens=5) for i in range(6)]
    async with LoadGenerator(fake.url) as gen:
        rep = await gen.run(requests, concurrency=3)
    assert gen.model == "fake-model"
    assert all(b["model"] == "fake-model" and b["stream"] and b["ignore_eos"] for b in fake.bodies)
    assert fake.max_in_flight == 3
    assert [r.index for r in rep.results] == list(range(6))
    for r in rep.results:
        assert r.ok, r.error
        assert r.output_tokens == 5 and r.prompt_tokens == 3
        assert r.text == "t0 t1 t2 t3 t4 " and r.finish_reason == "length"
        # lower bounds are exact (the server sleeps at least that long); the rest is the order of the
        # events each figure is taken at, which a busy machine stretches but cannot change. (Upper
        # bounds on the durations only measured the machine's load.)
        assert FIRST_TOKEN_DELAY <= r.ttft and TOKEN_GAP <= r.tpot
        assert r.sent_at < r.first_token_at < r.last_token_at <= r.done_at
        assert r.tpot == pytest.approx((r.last_token_at - r.first_token_at) / 4)
        assert r.latency >= r.ttft + 4 * TOKEN_GAP
    s = rep.summary()
    assert (s.requests, s.errors, s.output_tokens, s.prompt_tokens) == (6, 0, 30, 18)
    # two waves of three requests, each at least first delay + 4 gaps long
    assert s.duration_s >= 2 * (FIRST_TOKEN_DELAY + 4 * TOKEN_GAP)
    assert s.output_tok_s == pytest.approx(30 / s.duration_s)
    assert s.ttft_p50 == pytest.approx(percentile(rep.ttfts(), 50))
    assert s.tpot_p99 == pytest.approx(percentile(rep.tpots(), 99))
    assert s.latency_p99 >= s.latency_p50 >= s.ttft_p50


async def test_failures_are_counted_as_errors_and_left_out_of_the_statistics(fake):
    requests = [Request("fine", max_tokens=3), Request("fail", max_tokens=3), Request("break", max_tokens=5),
                Request("garbage", max_tokens=5)]
    async with LoadGenerator(fake.url, model="fake-model") as gen:
        rep = await gen.run(requests, concurrency=4)
    ok, failed = rep.ok, rep.errors
    assert [r.index for r in ok] == [0]
    errors = {r.index: r.error for r in failed}
    assert errors[1] == "HTTP 500: boom" and errors[2] == "the step failed"
    assert errors[3].startswith("malformed stream event")
    assert failed[0].status == 500
    s = rep.summary()
    assert (s.requests, s.errors, s.output_tokens) == (4, 3, 3)
    assert len(rep.latencies()) == 1


async def test_chat_requests_stream_deltas(fake):
    async with LoadGenerator(fake.url) as gen:
        r = await gen.complete(Request("hi there", max_tokens=3, chat=True, extra={"user": "tenant-a"}))
    assert r.ok and r.text == "t0 t1 t2 " and r.output_tokens == 3
    assert fake.bodies[-1]["messages"] == [{"role": "user", "content": "hi there"}]
    assert fake.bodies[-1]["user"] == "tenant-a"


async def test_background_load_keeps_its_concurrency_until_stopped(fake):
    stop = asyncio.Event()
    async with LoadGenerator(fake.url) as gen:
        task = asyncio.create_task(gen.run_until(stop, [Request("a", max_tokens=2), Request("b", max_tokens=2)], 2))
        await asyncio.sleep(0.6)
        stop.set()
        started = len(fake.bodies)
        rep = await asyncio.wait_for(task, 30)      # a hang guard only: timing is not what is tested
    # in-flight requests finish (every request the server saw is in the report, none is still open)
    # and no new one starts (at most the two that were on their way when stop was set)
    assert len(rep.results) == len(fake.bodies) and fake.in_flight == 0
    assert len(fake.bodies) - started <= 2
    assert fake.max_in_flight == 2
    assert len(rep.results) >= 2 and not rep.errors
    assert {fake.bodies[i]["prompt"] for i in range(2)} == {"a", "b"}


def test_percentile_interpolates_between_ranks():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([7], 99) == 7
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_report_writes_json_and_png_plots(tmp_path):
    path = report.write_json(tmp_path / "r" / "x.json", {"ratio": 2.5, "missing": float("nan"), "xs": [1.0]})
    assert json.loads(path.read_text()) == {"ratio": 2.5, "missing": None, "xs": [1.0]}
    pngs = [
        report.plot_throughput(tmp_path / "bars.png", {"transformers": 20.0, "engine": 50.0},
                               baseline="transformers", title="t"),
        report.plot_cdf(tmp_path / "cdf.png", {"a": [0.1, 0.3, 0.2], "b": []}, xlabel="s", title="t"),
        report.plot_histogram(tmp_path / "hist.png", {"apply": [0.5, 0.7, 3.0], "revert": [0.2]},
                              xlabel="ms", title="t", limit=8.0),
    ]
    for p in pngs:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    with pytest.raises(ValueError):
        report.plot_throughput(tmp_path / "bad.png", {"a": 1.0}, baseline="b", title="t")


def test_workloads_pick_the_prompts_they_promise():
    mixed = workload_prompts("mixed", 5, str(data_dir()), "navigate")
    assert len({p.task for p in mixed}) == 5
    one = workload_prompts("one-task", 4, str(data_dir()), "navigate")
    assert {p.task for p in one} == {"navigate"} and len({p.text for p in one}) == 4
    longest = long_prompts(6, str(data_dir()))
    lengths = [len(p.text) for p in longest]
    assert len(longest) == 6 and lengths == sorted(lengths, reverse=True)
    rest = [p for p in bbh_prompts(data_dir(), per_task=2) if p not in longest]
    assert min(lengths) >= max(len(p.text) for p in rest)
    with pytest.raises(ValueError):
        workload_prompts("random", 1, str(data_dir()), "navigate")


def test_bench_refuses_bad_arguments_before_starting_anything(tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    assert bench_main(parser.parse_args(["throughput", "-c", "0", "--out", str(tmp_path)])) == 2
    assert bench_main(parser.parse_args(["patches", "--patches", "kv-align", "--out", str(tmp_path)])) == 2
    assert bench_main(parser.parse_args(["apply", "--data-dir", str(tmp_path)])) == 2
    assert bench_main(parser.parse_args(["patches", "--patches", "base", "--out", str(tmp_path)])) == 2
    # the shadow suite needs a patch to apply, or the engine has nothing to compare against
    assert bench_main(parser.parse_args(["shadow", "--patches", "", "--out", str(tmp_path)])) == 2
    assert not any(tmp_path.iterdir())


async def test_open_loop_load_keeps_its_rate_whatever_the_server_speed(fake):
    stop = asyncio.Event()
    async with LoadGenerator(fake.url) as gen:
        task = asyncio.create_task(gen.run_at_rate(stop, [Request("x", max_tokens=3)], rate=20.0))
        await asyncio.sleep(0.5)
        stop.set()
        rep = await task
    # each request takes ~0.21 s, so a closed loop of one would have sent 2-3; 20/s sends ~10
    assert 7 <= len(rep.results) <= 12
    assert fake.max_in_flight >= 3 and not rep.errors
    assert [r.index for r in rep.results] == list(range(len(rep.results)))
