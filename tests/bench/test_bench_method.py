"""The benchmark's method without a model: load check, A/B alternation, ratio spread, engine flags,
the llama-server refusal."""
from __future__ import annotations

import argparse
import json

import pytest

from graft.bench import method, throughput
from graft.bench.args import add_bench_args
from graft.bench.cli import EXIT_BAD_INPUT, EXIT_BUSY, engine_flags
from graft.bench.cli import main as bench_main
from graft.bench.data import Prompt
from graft.bench import llama_server
from graft.bench.llama_server import BaselineUnavailable, LlamaSetting, llama_server_argv
from graft.bench.method import MachineBusy, alternation, check_load, ratio_spread
from graft.engine.config import EngineConfig, add_engine_args, auto_dtype, engine_argv
from tests.support import data_dir


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return parser.parse_args(list(argv))


def test_passes_alternate_side_by_side_round_by_round():
    assert list(alternation(3)) == [(0, "engine"), (0, "baseline"), (1, "engine"), (1, "baseline"),
                                    (2, "engine"), (2, "baseline")]
    assert list(alternation(1, ("3.2.0", "3.2.1"))) == [(0, "3.2.0"), (0, "3.2.1")]
    with pytest.raises(ValueError):
        list(alternation(0))


def test_the_ratio_is_the_median_of_rounds_paired_as_they_ran():
    spread = ratio_spread([30.0, 10.0, 24.0], [10.0, 10.0, 20.0])      # 3.0, 1.0, 1.2
    assert (spread.median, spread.low, spread.high) == (1.2, 1.0, 3.0)
    assert spread.as_dict()["per_round"] == [3.0, 1.0, 1.2]
    assert "min 1.00, max 3.00, 3 rounds" in str(spread)
    with pytest.raises(ValueError):
        ratio_spread([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        ratio_spread([1.0], [0.0])


def test_a_busy_machine_is_refused_unless_allowed():
    assert check_load(1.5, False, read=lambda: 1.5) == 1.5
    with pytest.raises(MachineBusy, match="load average is 3.20, above 1.5.*--allow-load"):
        check_load(1.5, False, read=lambda: 3.2)
    assert check_load(1.5, True, read=lambda: 3.2) == 3.2


def test_bench_exits_nonzero_on_a_busy_machine_before_starting_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(method, "load_average", lambda: 7.5)
    out = tmp_path / "out"
    assert bench_main(bench_args("throughput", "--data-dir", str(data_dir()), "--out", str(out))) == EXIT_BUSY
    assert "7.50" in capsys.readouterr().err and not out.exists()


class FakeSides:
    """Stands in for the engine and baseline processes: records the order passes ran in."""

    def __init__(self, rates: dict[str, list[float]]):
        self.rates, self.order = rates, []

    def run(self, side: str, r: int, prompts: list[str], label: str) -> throughput.Pass:
        self.order.append((side, r))
        return throughput.Pass(side, r, self.rates[side][r], 0, 0.5, 0.6)


def test_a_throughput_run_alternates_and_reports_the_median_ratio_with_its_spread():
    cfg = throughput.ThroughputConfig(rounds=3, baseline="engine")
    sides = FakeSides({"engine": [40.0, 30.0, 36.0], "baseline": [20.0, 30.0, 30.0]})
    entry = throughput.run_workload("mixed", [Prompt("t", "p", "a")] * 2, cfg, sides)
    assert sides.order == [("engine", 0), ("baseline", 0), ("engine", 1), ("baseline", 1),
                           ("engine", 2), ("baseline", 2)]
    assert entry["engine_tok_s"] == [40.0, 30.0, 36.0]
    assert entry["ratio"].median == pytest.approx(1.2) and entry["ratio"].low == 1.0 and entry["ratio"].high == 2.0
    assert [(p.load_before, p.load_after) for p in entry["passes"]] == [(0.5, 0.6)] * 6
    alone = throughput.run_workload("mixed", [], throughput.ThroughputConfig(rounds=2, baseline="none"),
                                    FakeSides({"engine": [1.0, 2.0]}))
    assert "ratio" not in alone and [p.side for p in alone["passes"]] == ["engine", "engine"]


def test_results_write_as_plain_json_with_a_plot_of_the_passes(tmp_path):
    from graft.bench import report
    passes = [throughput.Pass("engine", 0, 40.0, 0, 0.4, 0.5), throughput.Pass("baseline", 0, 20.0, 0, 0.5, 0.7)]
    data = report.plain({"passes": passes, "ratio": ratio_spread([40.0], [20.0])})
    assert json.loads(report.write_json(tmp_path / "r.json", data).read_text())["ratio"]["median"] == 2.0
    png = report.plot_passes(tmp_path / "p.png", data["passes"], data["ratio"],
                             names={"engine": "graft", "baseline": "transformers"}, title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_engine_flags_means_the_out_of_the_box_engine():
    assert engine_flags(bench_args("throughput")) == []
    assert engine_argv(bench_args("--dtype", "float32", "--no-prefix-caching")) == ["--dtype", "float32",
                                                                                  "--no-prefix-caching"]
    wide = engine_flags(bench_args("-c", "64"))
    budget = str(EngineConfig().max_num_batched_tokens)     # the default, whatever it is
    assert wide == ["--max-num-seqs", "64", "--max-num-batched-tokens", budget]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    serve = parser.parse_args([])
    bench = bench_args()
    assert {k: getattr(bench, k) for k in vars(serve)} == vars(serve), "bench and serve share the engine defaults"


def test_auto_dtype_is_bf16_only_where_the_cpu_computes_it():
    assert auto_dtype("cpu", None, flags={"avx512f", "avx512_bf16"}) == "bfloat16"
    assert auto_dtype("cpu", None, flags={"amx_bf16"}) == "bfloat16"
    assert auto_dtype("cpu", None, flags={"avx2", "avx512f"}) == "float32"
    assert EngineConfig(dtype="auto", device="cpu").dtype in ("bfloat16", "float32")
    with pytest.raises(ValueError, match="paths"):
        EngineConfig(paths="3.2.0")


def test_llama_server_baseline_is_refused_when_it_is_not_on_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setattr(llama_server, "BUILT", tmp_path / "not-built" / "llama-server")
    monkeypatch.setattr(method, "load_average", lambda: 0.1)
    with pytest.raises(BaselineUnavailable, match="llama-server.*PATH.*make llama-server"):
        throughput.Sides(throughput.ThroughputConfig(baseline="llama-server"))
    code = bench_main(bench_args("throughput", "--baseline", "llama-server", "--data-dir", str(data_dir()),
                                 "--out", str(tmp_path / "out")))
    assert code == EXIT_BAD_INPUT and "llama-server" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    argv = llama_server_argv("/bin/llama-server", "m.gguf", 8080, LlamaSetting(16, 256), 2)
    assert argv[argv.index("-np") + 1] == "16" and argv[argv.index("-c") + 1] == str(16 * 4096)
    assert argv[argv.index("-ub") + 1] == "256" and argv[argv.index("-t") + 1] == "2"


def test_llama_server_is_found_where_make_builds_it_or_where_llama_server_points(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    built = tmp_path / "build" / "bin" / "llama-server"
    built.parent.mkdir(parents=True)
    built.write_text("#!/bin/sh\n")
    monkeypatch.setattr(llama_server, "BUILT", built)
    with pytest.raises(BaselineUnavailable):
        llama_server.llama_server_binary()          # there, but not executable
    built.chmod(0o755)
    assert llama_server.llama_server_binary() == str(built)
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "elsewhere"))
    with pytest.raises(BaselineUnavailable, match="LLAMA_SERVER=.*not an executable"):
        llama_server.llama_server_binary()


def test_the_llama_server_sweep_measures_with_its_fastest_setting(monkeypatch):
    speeds = {(4, 512): 11.0, (16, 512): 9.0, (4, 2048): 12.5, (16, 2048): 8.0}
    ran = []

    def fake_pass(r, prompts, cfg, label, setting):
        ran.append((r, setting))
        return throughput.Pass("baseline", r, speeds[setting.slots, setting.ubatch], 0, 0.1, 0.1)
    monkeypatch.setattr(throughput, "llama_server_pass", fake_pass)
    cfg = throughput.ThroughputConfig(baseline="llama-server", llama_slots=[4, 16], llama_ubatch=[512, 2048])
    sweep = throughput.llama_server_sweep(["p"], cfg, "mixed")
    assert sweep["chosen"] == LlamaSetting(4, 2048)
    assert [p["output_tok_s"] for p in sweep["passes"]] == [11.0, 12.5, 9.0, 8.0] and len(ran) == 4
    ran.clear()
    one = throughput.llama_server_sweep(["p"], throughput.ThroughputConfig(llama_slots=[8]), "mixed")
    assert one == {"chosen": LlamaSetting(8, 512), "passes": []} and ran == []   # nothing to choose
