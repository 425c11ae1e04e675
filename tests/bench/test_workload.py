"""The workload suite: class loaders on the shared data, the knee, the isolation arithmetic, /metrics
parsing, streams against the fake OpenAI server, and one small real run through `graft bench`."""
from __future__ import annotations

import argparse
import json
import math

import pytest

from graft.engine.config import EngineConfig
from graft.bench.args import CLASS_CONCURRENCY, add_bench_args
from graft.bench.cli import EXIT_BAD_INPUT, engine_flags
from graft.bench.cli import main as bench_main
from graft.bench.data import (bbh_tasks, class_prompts, gsm8k_prompts, humaneval_prompts, mixed_bbh_prompts,
                              require_workload_data)
from graft.bench.loadgen import LoadGenerator, Request
from graft.bench.workload import (MIXED, TENANT_HEADER, Pool, Stream, WorkloadConfig, engine_gauges, find_knee,
                                  gauge_stats, interleave, isolation_table, load_requests, prefix_warmups,
                                  run_streams, scraping, slowdown, tenant_flags)
from graft.engine.metrics import EngineMetrics
from tests.bench import test_bench_smoke
from tests.support import data_dir

PNG = b"\x89PNG\r\n\x1a\n"
fake = test_bench_smoke.fake        # the fake OpenAI server of the load generator's tests


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return parser.parse_args(list(argv))


# ---- data ----

def test_gsm8k_and_humaneval_prompts_come_from_the_shared_data():
    gsm = gsm8k_prompts(3, data_dir())
    assert gsm[0].text.startswith("Question: Janet") and gsm[0].text.endswith("\nAnswer:")
    assert gsm[0].target == "18" and len({p.text for p in gsm}) == 3 and {p.task for p in gsm} == {"gsm8k"}
    code = humaneval_prompts(2, data_dir())
    assert [p.task for p in code] == ["HumanEval/0", "HumanEval/1"]
    assert code[0].text.startswith("from typing import List") and "def has_close_elements" in code[0].text
    assert code[0].target.strip().startswith("for idx")        # the canonical solution
    # more than the set holds: it cycles, as mixed_bbh_prompts does
    assert humaneval_prompts(166, data_dir())[164] == code[0]
    # short prompts against BBH's long ones: the point of mixing them
    bbh = class_prompts("bbh", 3, data_dir(), num_bbh_tasks=3)
    assert max(len(p.text) for p in gsm) * 3 < min(len(p.text) for p in bbh)
    with pytest.raises(ValueError, match="unknown workload class"):
        class_prompts("mmlu", 1, data_dir())


def test_bbh_class_stays_on_the_tasks_whose_prefixes_are_warmed():
    prompts = mixed_bbh_prompts(12, data_dir(), num_tasks=3)
    tasks = bbh_tasks(data_dir())[:3]
    assert [p.task for p in prompts] == tasks * 4 and len({p.text for p in prompts}) == 12
    cfg = WorkloadConfig(class_prompts={"bbh": 3, "gsm8k": 1, "humaneval": 1}, class_concurrency=CLASS_CONCURRENCY,
                         data_dir=str(data_dir()))
    warm = prefix_warmups(cfg)
    assert len(warm) == 3 and all(w.max_tokens == 1 for w in warm)
    assert all(p.text.startswith(w.prompt) for p, w in zip(prompts, warm))
    assert mixed_bbh_prompts(5, data_dir()) == mixed_bbh_prompts(5, data_dir(), num_tasks=None)


def test_missing_class_data_is_refused_naming_the_folder(tmp_path, capsys):
    (tmp_path / "bbh").mkdir()
    with pytest.raises(FileNotFoundError, match="no gsm8k/ folder"):
        gsm8k_prompts(1, tmp_path)
    with pytest.raises(FileNotFoundError, match="no humaneval/ folder"):
        humaneval_prompts(1, tmp_path)
    (tmp_path / "gsm8k").mkdir()
    with pytest.raises(FileNotFoundError, match="gsm8k has no test.jsonl"):
        require_workload_data(tmp_path)
    assert require_workload_data(data_dir()) == data_dir()
    out = tmp_path / "out"
    code = bench_main(bench_args("workload", "--data-dir", str(tmp_path), "--out", str(out), "--allow-load"))
    assert code == EXIT_BAD_INPUT and "test.jsonl" in capsys.readouterr().err and not out.exists()


def test_class_and_sweep_flags_are_checked_when_parsed(capsys):
    args = bench_args("workload")
    assert args.class_concurrency == {"bbh": 4, "gsm8k": 8, "humaneval": 4}
    assert args.class_prompts == {"bbh": 16, "gsm8k": 16, "humaneval": 16} and args.sweep == [1, 2, 4, 8, 16, 32, 64]
    assert bench_args("--class-concurrency", "gsm8k=16").class_concurrency == {"bbh": 4, "gsm8k": 16, "humaneval": 4}
    assert bench_args("--class-prompts", "3").class_prompts == {"bbh": 3, "gsm8k": 3, "humaneval": 3}
    assert bench_args("--sweep", "8,1,2,2").sweep == [1, 2, 8]
    for bad, says in ((["--class-concurrency", "mmlu=2"], "unknown workload class 'mmlu'"),
                      (["--class-prompts", "bbh=0"], "0 must be at least 1"),
                      (["--sweep", "1,x"], "'x' is not a whole number"), (["--sweep", ","], "names no concurrency")):
        with pytest.raises(SystemExit) as exc:
            bench_args("workload", *bad)
        assert exc.value.code == 2 and says in capsys.readouterr().err
    assert bench_main(bench_args("workload", "--sweep-waves", "0")) == EXIT_BAD_INPUT


def test_each_engine_gets_room_for_all_its_requests_in_flight():
    args = bench_args("workload", "--sweep", "1,64")
    assert engine_flags(args, 16) == []                 # within the default 32 sequences: no flags at all
    budget = str(EngineConfig().max_num_batched_tokens)     # the default, whatever it is
    assert engine_flags(args, max(args.sweep)) == ["--max-num-seqs", "64", "--max-num-batched-tokens", budget]
    assert engine_flags(bench_args("-c", "40")) == ["--max-num-seqs", "40", "--max-num-batched-tokens", budget]


def test_the_scheduling_order_is_an_engine_flag_for_before_and_after_runs():
    assert engine_flags(bench_args("workload"), 16) == []                     # fair, the default: no flag
    assert engine_flags(bench_args("workload", "--scheduling", "fcfs"), 16) == ["--scheduling", "fcfs"]


# ---- the knee ----

def test_the_knee_is_where_doubling_stops_paying():
    saturating = [(1, 10.0), (2, 19.0), (4, 35.0), (8, 50.0), (16, 54.0), (32, 55.0), (64, 53.0)]
    assert find_knee(saturating) == 8
    assert find_knee([(c, 10.0) for c in (1, 2, 4, 8)]) == 1                       # flat from the start
    assert find_knee([(c, 10.0 * c) for c in (1, 2, 4, 8, 16)]) is None           # still doubling at the end
    assert find_knee([(c, 10.0 * 1.05 ** i) for i, c in enumerate((1, 2, 4, 8))]) == 1   # 5% a doubling
    # a threshold of 10% a doubling: 9% is past the knee, 11% is not
    assert find_knee([(8, 50.0), (16, 54.5)]) == 8 and find_knee([(8, 50.0), (16, 55.5)]) is None


def test_the_knee_survives_one_noisy_point():
    # a dip at 4 does not make 2 the knee: 8 is far above it
    dip = [(1, 10.0), (2, 18.0), (4, 19.0), (8, 34.0), (16, 36.0), (32, 33.0), (64, 39.0)]
    assert find_knee(dip) == 8          # and the spike at 64 (+15% over three doublings) does not hide it
    # a point that rises well above the plateau again means the sweep has not flattened
    assert find_knee([*dip[:-1], (64, 50.0)]) is None
    # the order given does not matter; points without a figure are left out
    assert find_knee(list(reversed(dip))) == 8
    assert find_knee([(1, 10.0), (2, None), (4, math.nan), (8, 40.0), (16, 41.0)]) == 8
    assert find_knee([(1, 10.0)]) is None and find_knee([]) is None
    assert find_knee(dip, gain=0.5) == 2     # a laxer threshold finds an earlier knee


# ---- the isolation table ----

def summary(tok_s, ttft, tpot, requests=4, errors=0):
    return {"output_tok_s": tok_s, "ttft_p50": ttft, "ttft_p99": ttft * 2, "tpot_p50": tpot,
            "tpot_p99": None if tpot is None else tpot * 3, "requests": requests, "errors": errors}


def test_the_isolation_table_divides_mixed_by_alone_round_by_round():
    passes = []
    for r, (alone_tok, mixed_tok, mixed_ttft) in enumerate(((40.0, 20.0, 0.5), (50.0, 20.0, 0.3), (40.0, 30.0, 0.4))):
        passes += [{"phase": "bbh", "round": r, "classes": {"bbh": summary(alone_tok, 0.2, 0.05)}},
                   {"phase": "gsm8k", "round": r, "classes": {"gsm8k": summary(80.0, 0.1, 0.04)}},
                   {"phase": MIXED, "round": r, "classes": {"bbh": summary(mixed_tok, mixed_ttft, 0.1, errors=1),
                                                             "gsm8k": summary(40.0, 0.1, None, requests=9)}}]
    table = isolation_table(passes, ("bbh", "gsm8k"))["classes"]
    bbh = table["bbh"]
    assert bbh["alone"]["output_tok_s"] == 40.0 and bbh["mixed"]["output_tok_s"] == 20.0      # medians
    tok = bbh["mixed_over_alone"]["output_tok_s"]                # 0.5, 0.4, 0.75 paired by round
    assert (tok["median"], tok["min"], tok["max"]) == (0.5, 0.4, 0.75) and tok["per_round"] == [0.5, 0.4, 0.75]
    ttft = bbh["mixed_over_alone"]["ttft_p99"]                   # (2x mixed) / (2x alone): 2.5, 1.5, 2.0
    assert ttft["median"] == pytest.approx(2.0) and ttft["min"] == pytest.approx(1.5)
    assert bbh["mixed_over_alone"]["tpot_p50"]["median"] == pytest.approx(2.0)
    assert (bbh["requests_alone"], bbh["requests_mixed"], bbh["errors"]) == (12, 12, 3)
    gsm = table["gsm8k"]
    assert gsm["mixed_over_alone"]["output_tok_s"]["median"] == 0.5 and gsm["requests_mixed"] == 27
    # a figure missing in any round (no TPOT: one-token answers) has no ratio, not a wrong one
    assert gsm["mixed_over_alone"]["tpot_p50"] is None and gsm["mixed"]["tpot_p50"] is None
    assert slowdown([1.0], []) is None and slowdown([0.0], [1.0]) is None and slowdown([], []) is None


def isolation_round(r: int, alone: dict[str, float], mixed: dict[str, float], ttft: dict[str, tuple[float, float]]
                    ) -> list[dict]:
    """One round's passes: each class alone, then all mixed (TTFT p50 alone, mixed; p99 is twice p50)."""
    return [*({"phase": n, "round": r, "classes": {n: summary(alone[n], ttft[n][0], 0.02)}} for n in alone),
            {"phase": MIXED, "round": r, "classes": {n: summary(mixed[n], ttft[n][1], 0.03) for n in mixed}}]


def test_a_class_fair_share_is_the_mixed_total_split_as_the_classes_run_alone():
    # the last page's figures: alone 188.3 / 438.1 / 239.3, mixed 126.5 / 246.2 / 120.0 tok/s
    alone = {"bbh": 188.3, "gsm8k": 438.1, "humaneval": 239.3}
    mixed = {"bbh": 126.5, "gsm8k": 246.2, "humaneval": 120.0}
    ttft = {"bbh": (0.295, 0.368), "gsm8k": (0.166, 0.541), "humaneval": (0.157, 0.557)}
    result = isolation_table(isolation_round(0, alone, mixed, ttft))
    total = sum(mixed.values())
    assert result["mixed_total"]["output_tok_s"] == pytest.approx(total)
    assert result["mixed_total"]["best_alone_tok_s"] == 438.1
    assert result["mixed_total"]["over_best_alone"]["median"] == pytest.approx(total / 438.1)
    for name, entry in result["classes"].items():
        fair = total * alone[name] / sum(alone.values())
        assert entry["fair_share_tok_s"] == pytest.approx(fair)
        assert entry["mixed_over_fair_share"]["median"] == pytest.approx(mixed[name] / fair)
    # every class at its fair share is every class keeping the same share of its throughput alone
    even = isolation_table(isolation_round(0, alone, {n: 0.6 * v for n, v in alone.items()}, ttft))
    assert all(e["mixed_over_fair_share"]["median"] == pytest.approx(1.0) for e in even["classes"].values())
    goals = {g["target"]: g for g in result["targets"]}
    assert list(goals) == ["mixed total tok/s / best class alone", "bbh mixed tok/s / its fair share",
                           "gsm8k mixed tok/s / its fair share", "humaneval mixed tok/s / its fair share",
                           "gsm8k TTFT p99 mixed / alone", "humaneval TTFT p99 mixed / alone"]
    verdicts = {t: (g["pass"], g["limit"], g["at_least"]) for t, g in goals.items()}
    assert verdicts == {"mixed total tok/s / best class alone": (True, 0.95, True),      # 1.12x
                        "bbh mixed tok/s / its fair share": (True, 0.90, True),          # 1.18x
                        "gsm8k mixed tok/s / its fair share": (True, 0.90, True),        # 0.99x
                        "humaneval mixed tok/s / its fair share": (False, 0.90, True),   # 0.88x
                        "gsm8k TTFT p99 mixed / alone": (False, 2.0, False),             # 3.3x
                        "humaneval TTFT p99 mixed / alone": (False, 2.0, False)}         # 3.5x
    assert goals["gsm8k TTFT p99 mixed / alone"]["value"] == pytest.approx(0.541 / 0.166)


def test_fair_shares_pair_rounds_and_a_round_without_a_figure_judges_nothing():
    alone = {"bbh": 100.0, "gsm8k": 300.0}
    ttft = {"bbh": (0.2, 0.3), "gsm8k": (0.1, 0.15)}
    passes = (isolation_round(0, alone, {"bbh": 100.0, "gsm8k": 200.0}, ttft)      # total 300: fair 75 / 225
              + isolation_round(1, {"bbh": 100.0, "gsm8k": 100.0}, {"bbh": 50.0, "gsm8k": 150.0}, ttft))  # 100 / 100
    result = isolation_table(passes, ("bbh", "gsm8k"))
    bbh = result["classes"]["bbh"]
    assert bbh["mixed_over_fair_share"]["per_round"] == pytest.approx([100 / 75, 0.5])
    assert bbh["fair_share_tok_s"] == pytest.approx((75 + 100) / 2)
    assert result["mixed_total"]["over_best_alone"]["per_round"] == pytest.approx([1.0, 2.0])
    missing = isolation_table([p for p in passes if p["round"] == 0 and p["phase"] != "gsm8k"], ("bbh", "gsm8k"))
    assert missing["classes"]["bbh"]["fair_share_tok_s"] is None
    assert [g["pass"] for g in missing["targets"]][:3] == [None, None, None]


# ---- the engine's gauges ----

def test_kv_gauges_are_read_from_the_engines_own_metrics():
    metrics = EngineMetrics()
    metrics.set_revision(None, "base")
    metrics.kv_usage.set(0.625)
    metrics.kv_fragmentation.set(0.125)
    metrics.running.set(7)
    metrics.preemptions.inc(3)
    assert engine_gauges(metrics.render().decode()) == {"kv_usage": 0.625, "kv_fragmentation": 0.125,
                                                          "running": 7.0, "preemptions": 3.0}
    assert engine_gauges("# nothing here\n") == {}


def test_gauge_stats_count_only_samples_where_something_ran():
    samples = [{"kv_usage": 0.0, "kv_fragmentation": 0.0, "running": 0, "preemptions": 2},
               {"kv_usage": 0.5, "kv_fragmentation": 0.2, "running": 4, "preemptions": 2},
               {"kv_usage": 0.7, "kv_fragmentation": 0.1, "running": 8, "preemptions": 5},
               {"kv_usage": 0.0, "kv_fragmentation": 0.0, "running": 0, "preemptions": 6}]
    stats = gauge_stats(samples)
    assert (stats["samples"], stats["busy_samples"]) == (4, 2)
    assert stats["kv_usage_max"] == 0.7 and stats["kv_usage_mean"] == pytest.approx(0.6)
    assert stats["kv_fragmentation_max"] == 0.2 and stats["kv_fragmentation_mean"] == pytest.approx(0.15)
    assert stats["running_max"] == 8 and stats["preemptions"] == 4
    idle = gauge_stats([])
    assert idle["kv_usage_max"] is None and idle["preemptions"] is None and idle["samples"] == 0


# ---- prompts handed out and streams ----

def test_passes_on_one_engine_never_repeat_a_prompt_until_the_pool_is_spent():
    pool = Pool([Request(str(i)) for i in range(5)])
    assert [r.prompt for r in pool.take(2)] == ["0", "1"]
    assert [r.prompt for r in pool.ahead()] == ["2", "3", "4", "0", "1"]
    pool.advance(4)
    assert [r.prompt for r in pool.take(2)] == ["1", "2"]
    pools = {"a": Pool([Request("a0"), Request("a1")]), "b": Pool([Request("b0")])}
    assert [r.prompt for r in interleave(pools, 5)] == ["a0", "b0", "a1", "b0", "a0"]
    with pytest.raises(ValueError):
        Pool([])


async def test_each_class_is_a_tenant_of_the_engine(fake):
    cfg = WorkloadConfig(class_prompts={"bbh": 2, "gsm8k": 1, "humaneval": 1}, class_concurrency=CLASS_CONCURRENCY,
                         data_dir=str(data_dir()))
    requests = load_requests(cfg)
    assert {name: {r.headers[TENANT_HEADER] for r in reqs} for name, reqs in requests.items()} == \
        {name: {name} for name in requests}
    assert tenant_flags(["--dtype", "float32"]) == ["--dtype", "float32", "--tenant-header", TENANT_HEADER]
    assert tenant_flags(["--tenant-header=X-Team"]) == ["--tenant-header=X-Team"]
    async with LoadGenerator(fake.url) as gen:
        first = requests["gsm8k"][0]
        await gen.complete(Request(first.prompt, 2, headers=first.headers))
    assert fake.headers[-1][TENANT_HEADER] == "gsm8k"


async def test_every_stream_keeps_its_concurrency_until_every_class_has_its_count(fake):
    streams = [Stream("slow", [Request("s", max_tokens=8)], 1, 2), Stream("fast", [Request("f", max_tokens=2)], 3, 3)]
    async with LoadGenerator(fake.url) as gen, scraping(fake.url, every=0.05) as samples:
        reports = await run_streams(gen, streams, "test")
    slow, fast = reports["slow"], reports["fast"]
    assert len(slow.results) == 2 and not slow.errors and slow.concurrency == 1
    # the fast class went on while the slow one finished its two: more than its three, three at a time
    assert len(fast.results) > 3 and not fast.errors and fast.concurrency == 3
    assert fake.max_in_flight == 4 and fake.in_flight == 0
    assert max(r.sent_at for r in fast.results) > slow.results[0].done_at
    assert samples == []        # the fake has no /metrics: scrapes that fail are skipped, the pass goes on


# ---- one small real run ----

@pytest.mark.slow
def test_workload_suite_runs_end_to_end_through_graft_bench(tmp_path, capsys):
    # 24 new tokens: a sweep point then runs for about 0.7 s, long enough for the 0.25 s scrapes
    # to see it running (at 4 tokens, with the BBH prefix cached, a point could end unseen)
    out = tmp_path / "out"
    code = bench_main(bench_args(
        "workload", "--data-dir", str(data_dir()), "--out", str(out), "--allow-load", "--class-prompts", "2",
        "--class-concurrency", "bbh=1,gsm8k=2,humaneval=1", "--max-tokens", "24", "--sweep", "1,2",
        "--sweep-waves", "1", "--kv-cache-memory", "96M"))
    err = capsys.readouterr().err
    assert code == 0, err
    assert "mixed / alone" in err and "mixed / fair share" in err and "isolation targets" in err and "knee" in err
    data = json.loads((out / "workload.json").read_text())
    assert data["suite"] == "workload" and data["errors"] == 0
    assert data["config"]["engine_args"] == ["--kv-cache-memory", str(96 << 20)]   # 4 in flight: the default room
    passes = data["isolation"]["passes"]
    assert [p["phase"] for p in passes] == ["bbh", "gsm8k", "humaneval", MIXED]
    assert [sorted(p["classes"]) for p in passes] == [["bbh"], ["gsm8k"], ["humaneval"], ["bbh", "gsm8k", "humaneval"]]
    for name, entry in data["isolation"]["classes"].items():
        for side in ("alone", "mixed"):
            assert entry[side]["output_tok_s"] > 0 and entry[side]["ttft_p50"] > 0 and entry[side]["tpot_p50"] > 0
            assert entry[f"requests_{side}"] >= 2
        assert entry["mixed_over_alone"]["output_tok_s"]["median"] > 0, name
        assert entry["fair_share_tok_s"] > 0 and entry["mixed_over_fair_share"]["median"] > 0, name
    assert data["isolation"]["mixed_total"]["output_tok_s"] > 0
    assert [g["pass"] is not None for g in data["isolation"]["targets"]] == [True] * 6
    # BBH's prompts are several times longer than the others', as the classes promise
    tokens = {n: passes[i]["classes"][n]["prompt_tokens"] / passes[i]["classes"][n]["requests"]
              for i, n in enumerate(("bbh", "gsm8k", "humaneval"))}
    assert tokens["bbh"] > 3 * max(tokens["gsm8k"], tokens["humaneval"])
    points = data["sweep"]["points"]
    assert [(p["concurrency"], p["summary"]["requests"]) for p in points] == [(1, 1), (2, 2)]
    assert data["sweep"]["knee"] in (1, None)
    assert max(p["engine"]["kv_usage_max"] or 0 for p in points) > 0
    assert all(p["engine"]["samples"] >= 2 for p in points)
    assert all(0 <= (p["engine"]["kv_fragmentation_max"] or 0) <= 1 for p in points)
    for name in ("workload-isolation.png", "workload-sweep.png"):
        png = (out / name).read_bytes()
        assert png[:8] == PNG and len(png) > 10_000


def test_the_sweep_plot_is_drawn_when_no_point_has_a_latency(tmp_path):
    """A tiny run (a few tokens, a busy machine) can leave every TTFT/TPOT empty: the plot is still
    drawn, on a linear latency axis, where a log axis would refuse."""
    from graft.bench.workload import plot_sweep
    latencies = {"ttft_p50": None, "ttft_p99": None, "tpot_p50": None, "tpot_p99": None}
    engine = {"kv_usage_max": 0.1, "kv_usage_mean": 0.05, "kv_fragmentation_max": 0.2, "kv_fragmentation_mean": 0.1}
    result = {"sweep": {"knee": None, "points": [
        {"concurrency": c, "summary": {"output_tok_s": 10.0 * c, **latencies}, "engine": engine} for c in (1, 2)]},
        "config": {"sweep_waves": 2, "max_tokens": 4, "dtype": "bfloat16"}}
    path = plot_sweep(tmp_path / "sweep.png", result)
    assert path.stat().st_size > 0
