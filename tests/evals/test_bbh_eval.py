"""`graft eval bbh` against scripted OpenAI servers: the sample it draws, the answers it reads out of a
chain of thought, the JSON line it ends with, and how it treats an endpoint that fails or is not there."""
from __future__ import annotations

import json
import socket

import pytest

from graft.cli import main
from graft.evals import bbh
from tests.evals.fake_openai import fake_openai
from tests.support import data_dir

TASKS = "sports_understanding,date_understanding"


def run(capsys, *args: str) -> tuple[int, dict | None, str]:
    """`graft eval bbh ARGS`: exit code, its last stdout line as JSON (None when there is none), stderr."""
    code = main(["eval", "bbh", "--data-dir", str(data_dir()), *args])
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    return code, json.loads(lines[-1]) if lines else None, err


def targets(per_task: int = 3, seed: int = 0, shots: int = 3) -> dict[str, str]:
    return {q.prompt: q.target for q in bbh.sample(data_dir(), TASKS.split(","), per_task, seed, shots)}


def cot(answer: str) -> str:
    return f" Some reasoning here. So the answer is {answer}.\n\nQ: an invented next question"


@pytest.mark.parametrize("completion, answer", [
    (" Bam Adebayo is a basketball player. So the answer is yes.", "yes"),
    (" ... 04/12/1986 is option (B). So the answer is (B).", "(B)"),
    (" (2 + 3) * 4 = 20. So the answer is 20.", "20"),
    (" so the Answer is   False.\nQ: next", "False"),
    (" I am not sure.", None),
    (" So the answer is .", None),
    (" So the answer is", None),
])
def test_the_answer_is_what_the_chain_of_thought_states(completion, answer):
    assert bbh.extract_answer(completion) == answer


@pytest.mark.parametrize("answer, target, right", [
    ("(B)", "(B)", True),
    ("(B) 04/12/1986", "(B)", True),
    ("(C)", "(B)", False),
    ("B", "(B)", False),
    ("valid", "invalid", False),
    ("yes", "yes", True),
    ("Yes", "yes", False),
    (None, "yes", False),
])
def test_an_answer_is_scored_by_exact_match_or_its_option(answer, target, right):
    assert bbh.is_correct(answer, target) is right


def test_the_sample_is_the_same_for_a_seed_and_another_for_another_seed():
    a = bbh.sample(data_dir(), ["date_understanding", "snarks"], 4, seed=7)
    assert [(q.task, q.index) for q in a] == [(q.task, q.index) for q in
                                              bbh.sample(data_dir(), ["date_understanding", "snarks"], 4, seed=7)]
    assert [q.task for q in a] == ["date_understanding"] * 4 + ["snarks"] * 4
    b = bbh.sample(data_dir(), ["date_understanding", "snarks"], 4, seed=8)
    assert [q.index for q in a] != [q.index for q in b]
    # a task's draw does not depend on the other tasks asked for
    alone = bbh.sample(data_dir(), ["snarks"], 4, seed=7)
    assert [q.index for q in alone] == [q.index for q in a if q.task == "snarks"]


def test_shots_cut_the_cot_prompt_to_that_many_worked_examples():
    prompts = {shots: bbh.sample(data_dir(), ["sports_understanding"], 1, seed=0, shots=shots)[0].prompt
               for shots in range(4)}
    for shots, prompt in prompts.items():
        assert prompt.count("So the answer is") == shots
        assert prompt.count("\n\nQ: ") == shots + 1
        assert prompt.startswith("Determine whether an artificially constructed sentence")
        assert prompt.endswith("\nA: Let's think step by step.")
    assert len(prompts[0]) < len(prompts[1]) < len(prompts[3])


@pytest.mark.parametrize("args, message", [
    (["--tasks", "sports,date_understanding"], "--tasks: unknown BBH task 'sports'"),
    (["--per-task", "0"], "--per-task must be at least 1"),
    (["--shots", "4"], "--shots must be within [0, 3]"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["-c", "0"], "--concurrency must be at least 1"),
    (["--timeout", "0"], "--timeout must be positive"),
])
def test_bad_input_exits_2_naming_the_flag(capsys, args, message):
    code, result, err = run(capsys, "--url", "http://127.0.0.1:9", *args)
    assert (code, result) == (2, None)
    assert message in " ".join(err.split())


def test_a_data_folder_without_bbh_is_named(capsys, tmp_path):
    code = main(["eval", "bbh", "--url", "http://127.0.0.1:9", "--data-dir", str(tmp_path)])
    assert code == 2
    assert f"{tmp_path} has no bbh/ folder" in " ".join(capsys.readouterr().err.split())


def test_one_endpoint_scores_its_accuracy_and_prints_it_as_the_last_line(capsys):
    right = targets()
    wrong_ones = list(right)[:2]
    with fake_openai(lambda p: cot("(Z)") if p in wrong_ones else cot(right[p])) as fake:
        code, result, err = run(capsys, "--url", fake.url + "/v1", "--tasks", TASKS, "--max-tokens", "32")
    assert code == 0
    assert result["n"] == 6 and result["accuracy"] == round(4 / 6, 4)
    assert result["baseline_accuracy"] is None and result["difference"] is None and result["changed"] is None
    assert result["errors"] == 0
    assert set(result["per_task"]) == set(TASKS.split(","))
    # greedy, bounded, stopped before the model invents the next question
    assert {(r["temperature"], r["max_tokens"], tuple(r["stop"]), r["model"]) for r in fake.requests} == \
        {(0.0, 32, ("\n\nQ:",), "fake-model")}
    assert "6/6 answers" in err


def test_two_endpoints_give_the_difference_and_the_changed_answers(capsys):
    right = targets()
    prompts = list(right)
    worse = set(prompts[:3])              # the canary gets 3 wrong that the baseline gets right
    base_wrong = {prompts[5]}             # and both get one wrong, in different words
    canary = lambda p: cot("(Q)") if p in worse | base_wrong else cot(right[p])  # noqa: E731
    stable = lambda p: cot("(R)") if p in base_wrong else cot(right[p])  # noqa: E731
    with fake_openai(canary) as c, fake_openai(stable) as s:
        code, result, _ = run(capsys, "--url", c.url, "--baseline-url", s.url, "--tasks", TASKS, "-c", "2")
    assert code == 0
    assert result["accuracy"] == round(2 / 6, 4) and result["baseline_accuracy"] == round(5 / 6, 4)
    assert result["difference"] == 0.5
    assert result["changed"] == 4
    assert result["per_task"]["sports_understanding"] == {"n": 3, "accuracy": 0.0, "baseline_accuracy": 1.0}
    assert (result["errors"], result["baseline_errors"]) == (0, 0)
    assert len(c.requests) == len(s.requests) == 6


def test_an_engine_error_is_a_wrong_answer_counted_apart(capsys):
    right = targets()
    failing = list(right)[-1]
    with fake_openai(lambda p: 503 if p == failing else cot(right[p])) as fake:
        code, result, _ = run(capsys, "--url", fake.url, "--baseline-url", fake.url, "--tasks", TASKS)
    assert code == 0
    assert result["accuracy"] == round(5 / 6, 4) and result["baseline_accuracy"] == round(5 / 6, 4)
    assert (result["errors"], result["baseline_errors"], result["difference"]) == (1, 1, 0.0)


def test_a_full_queue_is_waited_out_not_counted(capsys):
    right = targets(per_task=1)
    tries: dict[str, int] = {}

    def busy_twice(p: str) -> str | int:
        tries[p] = tries.get(p, 0) + 1
        return 429 if tries[p] <= 2 else cot(right[p])
    with fake_openai(busy_twice) as fake:
        code, result, _ = run(capsys, "--url", fake.url, "--tasks", TASKS, "--per-task", "1")
    assert (code, result["accuracy"], result["errors"]) == (0, 1.0, 0)
    assert len(fake.requests) == 6


def test_an_unreachable_endpoint_exits_2_naming_it(capsys):
    with socket.socket() as s:                       # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    right = targets()
    with fake_openai(lambda p: cot(right[p])) as fake:
        code, result, err = run(capsys, "--url", fake.url, "--baseline-url", f"http://127.0.0.1:{port}",
                                "--tasks", TASKS)
    assert (code, result) == (2, None)
    assert f"http://127.0.0.1:{port} is unreachable" in " ".join(err.split())


def test_a_refused_question_exits_2_with_the_engines_reason(capsys):
    with fake_openai(lambda p: 400) as fake:
        code, result, err = run(capsys, "--url", fake.url, "--tasks", TASKS)
    assert (code, result) == (2, None)
    assert "refused a question with 400" in " ".join(err.split()) and "scripted 400" in err


@pytest.mark.parametrize("url, message", [
    ("127.0.0.1:8000", "'127.0.0.1:8000' is not an http:// or https:// URL with a host"),
    ("http://", "'http://' is not an http:// or https:// URL with a host"),
    ("ftp://127.0.0.1/", "'ftp://127.0.0.1/' is not an http:// or https:// URL with a host"),
])
def test_a_url_that_names_no_endpoint_exits_2(capsys, url, message):
    code, result, err = run(capsys, "--url", url, "--tasks", TASKS)
    assert (code, result) == (2, None)
    assert message in " ".join(err.split())


def test_an_endpoint_that_lists_no_model_is_not_scored(capsys):
    with fake_openai(lambda p: "") as fake:
        code, result, err = run(capsys, "--url", fake.url + "/nothing-here", "--tasks", TASKS)
    assert (code, result) == (2, None)
    assert "/nothing-here/v1/models answered 404" in " ".join(err.split())
