"""The input-grounded workload (bench/grounded.py): tasks quote real text of this repository
(a snapshot of it), are reproducible across commits, and reach bench.serve's requests with
their JSON schema when asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import grounded
from bench.client import Endpoint
from bench.serve import make_workload, parser
from bench.workloads import Grounded


def test_the_same_seed_gives_the_same_tasks_and_another_seed_other_ones():
    a, b, c = grounded.tasks(12, seed=3), grounded.tasks(12, seed=3), grounded.tasks(12, seed=4)
    assert a == b and a != c
    assert [t.kind for t in a] == list(grounded.KINDS) * 3


def test_tasks_come_from_the_snapshot_whatever_the_tree_holds(tmp_path: Path, monkeypatch):
    (tmp_path / "docs").mkdir()
    (tmp_path / "bench").mkdir()
    prose = "A paragraph long enough to be drawn, about lanterns and harbors. " * 6
    (tmp_path / "docs" / "only.md").write_text(prose + "\n")
    (tmp_path / "bench" / "one.py").write_text(
        "def f(a, b):\n" + "".join(f"    a = a + 1 if a <= {i} else a\n" for i in range(6))
        + "    return a\n")  # fmt: skip
    before = grounded.tasks(8, seed=7)
    mine = grounded.tasks(8, seed=7, root=tmp_path)  # drawn from that tree when asked
    assert {t.source for t in mine} == {"docs/only.md#0", "bench/one.py:f"}
    # a snapshot of a tree gives the tasks that tree gives
    written = tmp_path / "corpus.json"
    grounded.snapshot(tmp_path, written)
    assert grounded.corpus(written) == (grounded.paragraphs(tmp_path), grounded.functions(tmp_path))
    assert grounded.corpus(written) != grounded.corpus()

    def tree_read(*_args):
        raise AssertionError("the default tasks read the tree")

    monkeypatch.setattr(grounded, "paragraphs", tree_read)
    monkeypatch.setattr(grounded, "functions", tree_read)
    assert grounded.tasks(8, seed=7) == before


def test_every_prose_task_quotes_a_paragraph_of_the_docs_whole():
    texts = dict(grounded.corpus()[0])
    for task in grounded.tasks(16, seed=1):
        if task.kind != "fix":
            assert task.source.startswith("docs/")
            assert task.prompt.endswith(texts[task.source]), task.source


def test_a_fix_task_is_its_function_with_exactly_one_operator_flipped():
    code = dict(grounded.corpus()[1])
    fixes = [t for t in grounded.tasks(20, seed=2) if t.kind == "fix"]
    assert fixes
    for task in fixes:
        broken = task.prompt.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        original = code[task.source]
        assert broken != original
        repairs = [broken[:i] + good + broken[i + len(bad) :]
                   for good, bad in grounded.BUGS
                   for i in range(len(broken)) if broken.startswith(bad, i)]  # fmt: skip
        assert original in repairs, task.source


def test_an_extract_task_names_a_word_its_text_contains():
    for task in grounded.tasks(16, seed=5):
        if task.kind == "extract":
            word = task.prompt.split('"')[1]
            assert word in task.prompt.split("\n\n", 1)[1]


def test_a_json_task_asks_for_the_answer_object():
    task = grounded.tasks(1)[0]
    assert task.messages()[0]["content"] == task.prompt
    assert '"answer" field' in task.messages(as_json=True)[0]["content"]


def test_bench_serve_sends_grounded_tasks_with_their_schema_when_asked():
    a = parser().parse_args(["--workload", "grounded", "--num-prompts", "5", "--output-len", "64",
                             "--grounded-json"])  # fmt: skip
    workload = make_workload(a)
    assert isinstance(workload, Grounded) and workload.total == 5
    turns = workload.initial()
    assert [t.max_tokens for t in turns] == [64] * 5 and workload.done(turns[0], True, "") == []
    body = Endpoint("http://x/v1", "m").body(turns[0])
    assert body["response_format"]["json_schema"]["schema"] == grounded.SCHEMA
    assert body["messages"] == workload.tasks[0].messages(as_json=True)
    plain = make_workload(parser().parse_args(["--workload", "grounded"]))
    assert "response_format" not in Endpoint("http://x/v1", "m").body(plain.initial()[0])


@pytest.mark.parametrize("argv, flag", [(["--num-prompts", "0"], "--num-prompts"),
                                        (["--output-len", "0"], "--output-len")])  # fmt: skip
def test_bad_grounded_flags_raise_value_error_naming_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        make_workload(parser().parse_args(["--workload", "grounded", *argv]))
