"""`graft eval bbh` against a real `graft serve` engine (float32, the real model): an engine compared
with itself differs in nothing, and the test patch `longctx-test@1`, which its self-check passes and
short prompts cannot tell from base, loses BBH answers."""
from __future__ import annotations

import json

import httpx
import pytest

from graft.cli import main
from tests.support import data_dir, start_engine

pytestmark = pytest.mark.slow

# sports_understanding's 3-shot prompts are 235-242 tokens and its chains of thought about 25 tokens:
# the cheapest BBH task past the 208 tokens the patch is set to below
SAMPLE = ["--tasks", "sports_understanding", "--per-task", "6", "--max-tokens", "48", "-c", "3"]
SHORT = "Q: What is the capital of France?\nA:"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("eval"), "--enable-test-patches")
    yield eng
    eng.stop()


def evaluate(capsys, *args: str) -> dict:
    assert main(["eval", "bbh", "--data-dir", str(data_dir()), *SAMPLE, *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def greedy(eng, prompt: str) -> str:
    r = httpx.post(f"{eng.url}/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": prompt,
                                                       "max_tokens": 16, "temperature": 0}, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def test_an_engine_compared_with_itself_differs_in_nothing(engine, capsys):
    result = evaluate(capsys, "--url", engine.url, "--baseline-url", engine.url)
    assert result["n"] == 6
    assert result["accuracy"] == result["baseline_accuracy"] > 0
    assert (result["difference"], result["changed"], result["errors"], result["baseline_errors"]) == (0.0, 0, 0, 0)


def test_the_long_context_test_patch_passes_its_self_check_and_loses_bbh_answers(engine, capsys):
    before = evaluate(capsys, "--url", engine.url)
    short_before = greedy(engine, SHORT)
    with engine.admin() as admin:
        r = admin.post("/admin/patches", json={"name": "longctx-test", "version": "1", "source": {"builtin": True},
                                               "config": {"fromTokens": 208}})
        assert r.status_code == 200, r.text          # the self-check's probe (196 tokens) saw nothing
        try:
            assert greedy(engine, SHORT) == short_before
            after = evaluate(capsys, "--url", engine.url)
        finally:
            admin.delete("/admin/patches/longctx-test")
    assert after["errors"] == 0
    assert after["accuracy"] <= before["accuracy"] - 0.3, (before, after)
