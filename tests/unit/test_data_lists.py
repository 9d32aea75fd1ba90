"""Several data files: ``data.train_path`` / ``data.val_path`` as a list of files and hub datasets.

Rows are read in order, each file formatted on its own (errors name ``data.<key>[i]``), a row without a
``data_source`` takes its file's name (validation reports each test set), and ``data.max_val_samples`` caps each
file. A single path is still a string (a checkpoint's config compares equal)."""

from __future__ import annotations

import json

import pytest

from helpers import make_cfg
from hybrid_rl.config import ConfigError
from hybrid_rl.data.feed import read_prompts, source_name
from hybrid_rl.data.tasks import DataError


@pytest.fixture(scope="module")
def tok():
    from hybrid_rl.models import build_tiny_tokenizer

    return build_tiny_tokenizer()


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_list_of_files_is_read_in_order_each_named_after_its_file(tmp_path, tok):
    a = _write(tmp_path / "math500.jsonl", [{"problem": str(i), "answer": str(i)} for i in range(5)])
    b = _write(tmp_path / "aime.jsonl", [{"problem": str(i), "answer": str(i), "data_source": "aime24"} for i in range(3)])
    c = _write(tmp_path / "extra.jsonl", [{"problem": "7", "answer": "7"}])
    cfg = make_cfg("data.task=math", f"data.train_path={a}", f"data.val_path=[{a},{b},{c}]", "data.max_prompt_length=256")
    assert cfg.data.val_path == [str(a), str(b), str(c)]
    ds = read_prompts(cfg, tok, "val_path", "test", 1, 0, cap=4)
    items = [ds[i] for i in range(len(ds))]
    assert [it["data_source"] for it in items] == ["math500"] * 4 + ["aime24"] * 3 + ["extra"]
    assert [it["ground_truth"] for it in items] == ["0", "1", "2", "3", "0", "1", "2", "7"]
    assert [it["index"] for it in items] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert ds.sources == ["aime24", "extra", "math500"]


def test_one_path_stays_a_string_and_keeps_the_tasks_source(tmp_path, tok):
    a = _write(tmp_path / "t.jsonl", [{"problem": "1", "answer": "1"}])
    cfg = make_cfg("data.task=math", f"data.train_path={a}", f"data.val_path={a}", "data.max_prompt_length=256")
    assert cfg.data.val_path == str(a)
    assert read_prompts(cfg, tok, "val_path", "test", 1, 0)[0]["data_source"] == "math"


def test_a_bad_row_names_its_entry_of_the_list(tmp_path, tok):
    a = _write(tmp_path / "ok.jsonl", [{"problem": "1", "answer": "1"}])
    b = _write(tmp_path / "bad.jsonl", [{"problem": "1", "answer": "1"}, {"problem": "2"}])
    cfg = make_cfg("data.task=math", f"data.train_path=[{a},{b}]", "data.max_prompt_length=256")
    with pytest.raises(DataError) as ei:
        read_prompts(cfg, tok, "train_path", "train", 1, 0)
    assert str(ei.value).startswith(f"data.train_path[1]={str(b)!r}: row 2 has no 'answer' field")
    missing = tmp_path / "none.jsonl"
    cfg = make_cfg("data.task=math", f"data.train_path=[{a},{missing}]")
    with pytest.raises(DataError) as ei:
        read_prompts(cfg, tok, "train_path", "train", 1, 0)
    assert str(ei.value).startswith(f"data.train_path[1]={str(missing)!r}: no such file")


@pytest.mark.parametrize("value", ["[]", "[synthetic:successor]"])
def test_a_list_takes_files_only(value):
    with pytest.raises(ConfigError) as ei:
        make_cfg(f"data.train_path={value}")
    assert "a list takes one or more files or hub datasets" in str(ei.value)


def test_source_names():
    assert source_name("data/test/math500.jsonl") == "math500" and source_name("x.parquet") == "x"
    assert source_name("HuggingFaceH4/MATH-500") == "MATH-500" and source_name("openai/gsm8k") == "gsm8k"
