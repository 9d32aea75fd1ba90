"""Tests for hybrid_rl.data: row sources, tasks, prompt datasets/collate, and the sampler."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from hybrid_rl.data import (TASKS, DataError, PromptDataset, PromptSampler, collate_prompts,  # noqa: E402
                            load_rows)

# 1,024 rows of the GSM8K train split, shipped with the benchmarks (benchmarks/data/README.md)
GSM8K_1K = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "gsm8k_train_1k.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    from hybrid_rl.models import build_tiny_tokenizer

    return build_tiny_tokenizer()


# --------------------------------------------------------------------------- sources
def test_jsonl_rows_and_blank_lines(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"digit": 1}\n\n{"digit": 2}\n')
    assert load_rows(str(p), "train", None, "successor", 0, 0) == [{"digit": 1}, {"digit": 2}]


@pytest.mark.parametrize("bad, what", [("{not json", "not valid JSON"), ("[1, 2]", "expected an object")])
def test_jsonl_malformed_line_names_file_and_line(tmp_path, bad, what):
    p = tmp_path / "d.jsonl"
    p.write_text('{"digit": 1}\n' + bad + "\n")
    with pytest.raises(DataError) as ei:
        load_rows(str(p), "train", None, "successor", 0, 0)
    msg = str(ei.value)
    assert f"{p}:2:" in msg and what in msg and "\n" not in msg


def test_missing_local_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError) as ei:
        load_rows(str(missing), "train", None, "gsm8k", 0, 0)
    msg = str(ei.value)
    assert str(missing) in msg and "data.train_path" in msg and "data.val_path" not in msg  # the key at fault only
    with pytest.raises(DataError, match="data.val_path"):
        load_rows("nope.parquet", "test", None, "gsm8k", 0, 0, key="data.val_path")


def test_parquet_round_trip(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?", "answer": "#### 4"}]
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), p)
    assert load_rows(str(p), "train", None, "gsm8k", 0, 0) == rows


def test_unsupported_local_file_type(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("a,b\n")
    with pytest.raises(DataError, match="convert it to .jsonl or .parquet"):
        load_rows(str(p), "train", None, "gsm8k", 0, 0)


def test_hub_failure_is_one_line_data_error(monkeypatch):
    import types

    def fail(*args, **kwargs):
        raise ConnectionError("offline\nsecond line")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=fail))
    with pytest.raises(DataError) as ei:
        load_rows("openai/gsm8k", "train", "main", "gsm8k", 0, 0)
    msg = str(ei.value)
    assert "data.train_path" in msg and "'openai/gsm8k'" in msg and "offline" in msg and "\n" not in msg


def test_hub_rows_via_datasets(monkeypatch):
    import types

    seen = {}

    def load(name, config, split):
        seen.update(name=name, config=config, split=split)
        return [{"question": "q", "answer": "#### 1"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load))
    assert load_rows("openai/gsm8k", "test", "main", "gsm8k", 0, 0) == [{"question": "q", "answer": "#### 1"}]
    assert seen == {"name": "openai/gsm8k", "config": "main", "split": "test"}


def test_synthetic_source_and_errors():
    rows = load_rows("synthetic:successor", "train", None, "successor", 50, 3)
    assert rows == TASKS["successor"].generate(50, 3)
    with pytest.raises(DataError, match="synthetic:successor"):
        load_rows("synthetic:nope", "train", None, "successor", 50, 3)
    with pytest.raises(DataError, match="data.task"):
        load_rows("synthetic:successor", "train", None, "gsm8k", 50, 3)


# --------------------------------------------------------------------------- tasks
def test_gsm8k_format_real_file():
    rows = load_rows(str(GSM8K_1K), "train", None, "gsm8k", 0, 0)
    assert len(rows) == 1024
    out = TASKS["gsm8k"].format_row(rows[0], 0)
    assert out["ground_truth"] == "72"
    assert out["data_source"] == "gsm8k"
    (msg,) = out["messages"]
    assert msg["role"] == "user"
    assert msg["content"].startswith("Natalia")
    assert msg["content"].endswith("\nLet's think step by step and output the final answer after \"####\".")
    truths = [TASKS["gsm8k"].format_row(r, i)["ground_truth"] for i, r in enumerate(rows)]
    assert all("," not in t and t == t.strip() for t in truths)
    assert all(float(t) == float(t) for t in truths)  # every ground truth is a number
    assert truths[345] == "1080"  # "#### 1,080" in the file


def test_gsm8k_commas_and_missing_field():
    task = TASKS["gsm8k"]
    assert task.format_row({"question": "q", "answer": "so 1000 + 234\n#### 1,234 "}, 0)["ground_truth"] == "1234"
    with pytest.raises(DataError) as ei:
        task.format_row({"answer": "#### 3"}, 7)
    msg = str(ei.value)
    assert "row 7" in msg and "'question'" in msg and "data.task" in msg


def test_successor_generation_deterministic_and_uniform():
    task = TASKS["successor"]
    a, b, c = task.generate(5000, 0), task.generate(5000, 0), task.generate(5000, 1)
    assert a == b and a != c
    counts = Counter(r["digit"] for r in a)
    assert set(counts) == set(range(10))
    assert all(400 <= n <= 600 for n in counts.values())  # expected 500 each
    out = task.format_row({"digit": 9}, 0)
    assert out == {"messages": [{"role": "user", "content": "9"}], "ground_truth": "0", "data_source": "successor"}
    assert task.format_row({"digit": 3}, 0)["ground_truth"] == "4"
    with pytest.raises(DataError, match="0-9"):
        task.format_row({"digit": 12}, 0)


# --------------------------------------------------------------------------- prompts
def _rows(lengths):
    # gsm8k rows whose question has the given number of characters (1 token each for the tiny tokenizer)
    return [{"question": "x" * n, "answer": f"#### {i}"} for i, n in enumerate(lengths)]


def test_prompt_dataset_items(tokenizer):
    ds = PromptDataset([{"digit": 4}, {"digit": 9}], "successor", tokenizer, 64, "error")
    item = ds[1]
    assert item["ground_truth"] == "0" and item["data_source"] == "successor" and item["index"] == 1
    assert tokenizer.decode(item["input_ids"]) == "<|im_start|>user\n9<|im_end|>\n<|im_start|>assistant\n"
    sys_ds = PromptDataset([{"digit": 4}], "successor", tokenizer, 64, "error", system_prompt="S")
    assert tokenizer.decode(sys_ds[0]["input_ids"]).startswith("<|im_start|>system\nS<|im_end|>")


def test_truncation_modes(tokenizer):
    base = len(PromptDataset(_rows([0]), "gsm8k", tokenizer, 10_000, "error")[0]["input_ids"])
    limit = base + 10
    rows = _rows([5, 30, 8, 40])  # rows 2 and 4 (counted from 1) are too long

    with pytest.raises(DataError) as ei:
        PromptDataset(rows, "gsm8k", tokenizer, limit, "error")
    assert "data.max_prompt_length" in str(ei.value) and "the prompt of row 2 of the dataset has" in str(ei.value)

    filt = PromptDataset(rows, "gsm8k", tokenizer, limit, "filter")
    assert (len(filt), filt.num_filtered, filt.num_truncated) == (2, 2, 0)
    assert [filt[i]["index"] for i in range(2)] == [0, 2]
    assert [filt[i]["ground_truth"] for i in range(2)] == ["0", "2"]

    full = PromptDataset(rows, "gsm8k", tokenizer, 10_000, "error")[1]["input_ids"]
    left = PromptDataset(rows, "gsm8k", tokenizer, limit, "left")
    right = PromptDataset(rows, "gsm8k", tokenizer, limit, "right")
    assert (len(left), left.num_filtered, left.num_truncated) == (4, 0, 2)
    assert right.num_truncated == 2
    assert left[1]["input_ids"] == full[-limit:]
    assert right[1]["input_ids"] == full[:limit]
    assert all(len(left[i]["input_ids"]) <= limit for i in range(4))

    with pytest.raises(DataError, match="data.max_prompt_length"):
        PromptDataset(_rows([50, 60]), "gsm8k", tokenizer, limit, "filter")
    with pytest.raises(DataError, match="data.truncation"):
        PromptDataset(rows, "gsm8k", tokenizer, limit, "middle")


def test_collate_left_pads():
    items = [{"input_ids": [5, 6, 7], "ground_truth": "a", "data_source": "t", "index": 4},
             {"input_ids": [8], "ground_truth": "b", "data_source": "t", "index": 9}]
    batch = collate_prompts(items, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["input_ids"].dtype == batch["attention_mask"].dtype == __import__("torch").long
    assert list(batch["ground_truth"]) == ["a", "b"] and list(batch["index"]) == [4, 9]
    assert list(batch["data_source"]) == ["t", "t"] and len(batch) == 2


# --------------------------------------------------------------------------- sampler
def _draw(sampler, n):
    return [sampler.next_indices() for _ in range(n)]


def test_sampler_deterministic_and_rank_slices():
    n, gbs, ws = 23, 8, 4
    full = _draw(PromptSampler(n, gbs, 0, 1, seed=5), 6)
    assert full == _draw(PromptSampler(n, gbs, 0, 1, seed=5), 6)
    assert full != _draw(PromptSampler(n, gbs, 0, 1, seed=6), 6)
    ranks = [_draw(PromptSampler(n, gbs, r, ws, seed=5), 6) for r in range(ws)]
    for step in range(6):
        parts = [ranks[r][step] for r in range(ws)]
        assert all(len(p) == gbs // ws for p in parts)
        assert sum(parts, []) == full[step]  # contiguous slices, in rank order
        assert len(set(sum(parts, []))) == gbs


def test_sampler_epoch_rollover():
    s = PromptSampler(23, 8, 0, 1, seed=0)
    assert s.steps_per_epoch == 2  # 23 // 8; the 7-prompt tail is dropped
    e0 = _draw(s, 2)
    assert s.epoch == 1 and s.state_dict() == {"epoch": 1, "step_in_epoch": 0}
    e1 = _draw(s, 2)
    assert len(set(sum(e0, []))) == 16 and len(set(sum(e1, []))) == 16
    assert e0 != e1  # a new permutation per epoch
    ordered = PromptSampler(16, 8, 0, 1, seed=0, shuffle=False)
    assert _draw(ordered, 3) == [list(range(8)), list(range(8, 16)), list(range(8))]


def test_sampler_resume_matches():
    original = PromptSampler(50, 12, 1, 2, seed=11)
    _draw(original, 5)
    state = original.state_dict()
    resumed = PromptSampler(50, 12, 1, 2, seed=11)
    resumed.load_state_dict(state)
    assert _draw(resumed, 9) == _draw(original, 9)


def test_sampler_errors():
    with pytest.raises(DataError, match="data.train_batch_size"):
        PromptSampler(10, 16, 0, 1, seed=0)
    with pytest.raises(DataError, match="divisible"):
        PromptSampler(100, 10, 0, 4, seed=0)
    s = PromptSampler(100, 10, 0, 1, seed=0)
    with pytest.raises(DataError, match="data.train_batch_size"):
        s.load_state_dict({"epoch": 0, "step_in_epoch": 10})
    with pytest.raises(DataError):
        s.load_state_dict({"epoch": 0})


def test_batch_index_consecutive_rows_is_a_view_and_equals_the_gather():
    import numpy as np
    import torch

    from hybrid_rl.batch import Batch, as_slice

    b = Batch({"x": torch.arange(20).reshape(10, 2)}, {"s": [str(i) for i in range(10)]})
    run = b.index(np.arange(3, 7))
    assert run.tensors["x"].data_ptr() == b.tensors["x"][3].data_ptr()  # no copy
    assert torch.equal(run.tensors["x"], b.tensors["x"][3:7]) and list(run.non_tensors["s"]) == ["3", "4", "5", "6"]
    gathered = b.index([7, 2, 2])
    assert gathered.tensors["x"].tolist() == [[14, 15], [4, 5], [4, 5]] and list(gathered.non_tensors["s"]) == ["7", "2", "2"]
    assert as_slice(np.array([2, 3, 4])) == slice(2, 5) and as_slice(np.array([2, 4])) is None
    assert as_slice(np.array([], dtype=np.int64)) is None and len(b.index(np.array([], dtype=np.int64))) == 0


@pytest.mark.gpu
def test_batch_moves_to_the_gpu_through_pinned_memory_without_blocking():
    """Host → GPU moves and gathers of a host batch land the same values as plain copies (pinned, non-blocking)."""
    import numpy as np
    import torch

    from hybrid_rl.batch import Batch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    host = Batch({"x": torch.arange(4000).reshape(1000, 4), "m": torch.rand(1000, 3)[:, :2],  # a strided view
                  "e": torch.rand(1000, 1).expand(1000, 5)})  # an expanded one (stride 0)
    moved = host.to("cuda")
    idx = np.random.default_rng(0).permutation(1000)[:300]
    gathered = moved.index(idx)
    torch.cuda.synchronize()
    for k, v in host.tensors.items():
        assert moved.tensors[k].is_cuda and torch.equal(moved.tensors[k].cpu(), v)
        assert torch.equal(gathered.tensors[k].cpu(), v[torch.as_tensor(idx)])


def test_a_row_without_the_tasks_field_names_the_key_the_file_the_row_and_the_field(tokenizer, tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"prompt": "2+2?", "answer": "#### 4"}\n')
    rows = load_rows(str(path), "test", None, "gsm8k", 0, 0, key="data.val_path")
    with pytest.raises(DataError) as ei:
        PromptDataset(rows, "gsm8k", tokenizer, 1000, source=f"data.val_path={str(path)!r}")
    msg = str(ei.value)
    assert msg.startswith(f"data.val_path={str(path)!r}: row 2 has no 'question' field, which the gsm8k task needs "
                          f"(its fields: ['answer', 'prompt'])"), msg
    assert "data.train_path" not in msg
    with pytest.raises(DataError, match=r"data.train_path='x.jsonl': row 1: its 'question' field, which the gsm8k "
                                        r"task needs, is null"):
        PromptDataset([{"question": None, "answer": "#### 1"}], "gsm8k", tokenizer, 1000,
                      source="data.train_path='x.jsonl'")


def test_the_loader_names_only_the_key_at_fault(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    for key in ("data.train_path", "data.val_path"):
        with pytest.raises(DataError) as ei:
            load_rows(str(empty), "train", None, "gsm8k", 0, 0, key=key)
        other = "data.val_path" if key == "data.train_path" else "data.train_path"
        assert key in str(ei.value) and other not in str(ei.value) and str(empty) in str(ei.value)
