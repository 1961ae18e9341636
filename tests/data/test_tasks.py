"""Task registry: request construction on hand-written rows (lm-eval 0.4.13's rules, written out independently),
and the cached files against their pinned row counts."""

import json

import pytest

from outlierscope.cli import main
from outlierscope.data.tasks import TASKS, expand_tasks, get_task, load_docs, task_metrics
from outlierscope.errors import OutlierscopeError

ROWS = {
    "arc_easy": ({"question": "Which is a gas?", "answerKey": "3",  # numeric answer keys occur in ARC
                  "choices": "{'text': ['ice', 'steam', 'oxygen'], 'label': ['1', '2', '3']}"},
                 [("Question: Which is a gas?\nAnswer:", " ice"), ("Question: Which is a gas?\nAnswer:", " steam"),
                  ("Question: Which is a gas?\nAnswer:", " oxygen")], 2, [3, 5, 6]),
    "boolq": ({"passage": "Cats purr.", "question": "do cats purr", "answer": "True"},
              [("Cats purr.\nQuestion: do cats purr?\nAnswer:", " no"), ("Cats purr.\nQuestion: do cats purr?\nAnswer:", " yes")],
              1, [2, 3]),
    "openbookqa": ({"question_stem": "The sun is", "answerKey": " B",
                    "choices": {"text": ["cold", "a star"], "label": ["A", "B"]}},
                   [("The sun is", " cold"), ("The sun is", " a star")], 1, [4, 6]),
    "piqa": ({"goal": "Open a jar", "sol1": "twist the lid ", "sol2": "freeze it", "label": "0"},
             [("Question: Open a jar\nAnswer:", " twist the lid "), ("Question: Open a jar\nAnswer:", " freeze it")], 0,
             [14, 9]),  # choices are not stripped
    "winogrande": ({"sentence": "Sarah beat Maria because _ trained more.", "option1": "Sarah", "option2": "Maria",
                    "answer": "1"},
                   [("Sarah beat Maria because Sarah", " trained more."), ("Sarah beat Maria because Maria", " trained more.")],
                   0, [30, 30]),  # partial scoring: a context per option, one continuation
    "sciq": ({"support": "", "question": "What is H2O?", "distractor1": "salt", "distractor2": "air",
              "distractor3": "gold", "correct_answer": "water"},
             [("\nQuestion: What is H2O?\nAnswer:", f" {c}") for c in ("salt", "air", "gold", "water")], 3, [4, 3, 4, 5]),
    "copa": ({"premise": "The man turned on the faucet.", "choice1": "The toilet filled.", "choice2": "Water flowed.",
              "question": "effect", "label": "1"},
             [("The man turned on the faucet therefore", "  the toilet filled."),
              ("The man turned on the faucet therefore", "  water flowed.")], 1, [19, 14]),  # two spaces
    "social_iqa": ({"context": "Tracy stayed out.", "question": "What next?", "answerA": "sleep", "answerB": "eat",
                    "answerC": "go", "label": "2"},
                   [("Q: Tracy stayed out. What next?\nA:", f" {c}") for c in ("sleep", "eat", "go")], 1, [5, 3, 2]),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_requests_from_hand_written_rows(name):
    row, requests, gold, chars = ROWS[name]
    doc = get_task(name).build(7, row)
    assert [list(r) for r in doc.requests] == [list(r) for r in requests]
    assert doc.gold == gold and list(doc.choice_chars) == chars and doc.index == 7
    assert doc.json() == {"doc_id": 7, "requests": [list(r) for r in requests], "gold": gold}


def test_every_task_has_a_test_row():
    assert set(TASKS) == set(ROWS) | {"arc_challenge"}


def test_boolq_answer_may_be_a_bool():
    assert get_task("boolq").build(0, {"passage": "p", "question": "q", "answer": False}).gold == 0


def test_unknown_task_did_you_mean():
    with pytest.raises(OutlierscopeError, match="did you mean winogrande"):
        get_task("winogrand")


@pytest.mark.parametrize("name", list(TASKS))
def test_cached_files_have_the_pinned_rows(name):
    t = get_task(name)
    if not t.cached:
        pytest.skip("task data not cached (make test fetches it)")
    docs = load_docs(name)
    assert len(docs) == t.rows
    assert all(0 <= d.gold < len(d.requests) for d in docs)
    assert {len(d.requests) for d in docs} <= {2, 3, 4, 5}


def test_tasks_cli(capsys):
    assert main(["tasks"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in TASKS) and "hellaswag" in out
    if get_task("copa").cached:
        assert main(["tasks", "requests", "copa", "--limit", "2"]) == 0
        lines = capsys.readouterr().out.strip().splitlines()
        assert len(lines) == 2 and json.loads(lines[0])["doc_id"] == 0
    assert main(["tasks", "requests", "cpoa"]) == 2
    assert "did you mean copa" in capsys.readouterr().err


def test_tasks_requests_of_hellaswag(hellaswag_cached, capsys):
    """The main task, which `tasks` lists, is accepted too: the first validation item of the public HellaSwag set
    (gold ending 3, "starts pulling up roofing on a roof.") as lm-eval's requests."""
    assert main(["tasks", "requests", "hellaswag", "--limit", "2"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert len(lines) == 2 and [len(d["requests"]) for d in lines] == [4, 4]
    assert lines[0]["gold"] == 3 and lines[0]["requests"][3] == [
        "Roof shingle removal: A man is sitting on a roof. He", " starts pulling up roofing on a roof."]


@pytest.mark.parametrize("names, expected", [
    (["paper"], ("arc_challenge", "arc_easy", "boolq", "hellaswag", "openbookqa", "piqa", "winogrande")),
    (["copa", "all"], ("copa", "hellaswag", "arc_easy", "arc_challenge", "boolq", "openbookqa", "piqa", "winogrande",
                       "sciq", "social_iqa")),
    (["piqa", "piqa", "hellaswag"], ("piqa", "hellaswag")),
])
def test_expand_tasks(names, expected):
    assert expand_tasks(names) == expected


def test_expand_tasks_unknown():
    with pytest.raises(OutlierscopeError, match="did you mean"):
        expand_tasks(["paper", "sciqq"])


@pytest.mark.parametrize("typo, meant", [("hellaswg", "hellaswag"), ("papr", "paper")])
def test_unknown_task_lists_every_name(typo, meant):
    """The error lists HellaSwag and the suites beside the registered tasks, and suggests them."""
    with pytest.raises(OutlierscopeError) as e:
        expand_tasks([typo])
    msg = str(e.value)
    assert f"did you mean {meant}" in msg and "\n" not in msg
    assert all(n in msg.split("did you mean")[0] for n in ["hellaswag", "paper", "all", *TASKS])


def test_task_metrics_follow_lmeval():
    """lm-eval 0.4.13 reports acc only for BoolQ, WinoGrande, COPA and Social IQa (their yamls' metric_list)."""
    acc_only = {n for n in TASKS if task_metrics(n) == ("acc",)}
    assert acc_only == {"boolq", "winogrande", "copa", "social_iqa"} and task_metrics("hellaswag") == ("acc", "acc_norm")
