"""``benchmarks/publish.py`` and the benchmarks' output policy (``bench_common.run_dir``): every benchmark writes into
a run directory, and a result reaches the curated folder only through the publish step, which checks that it records
its commit, device and settings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import publish  # noqa: E402
from bench_common import RESULTS, run_dir  # noqa: E402

GOOD = {"bench": "x", "commit": "abc123", "device": "H200x2", "overrides": ["actor.lr=1e-6"], "step_s": 1.5}


def _write(folder: Path, name: str, doc: dict, png: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(doc))
    if png:
        path.with_suffix(".png").write_bytes(b"\x89PNG fake")
    return path


def test_default_run_directory_and_the_curated_folder_refused(tmp_path):
    default = run_dir("soak")
    assert default.parent == ROOT / "runs" / "soak" and len(default.name) == len("20261201T120000Z")
    assert run_dir("soak", tmp_path / "mine") == tmp_path / "mine"
    with pytest.raises(SystemExit, match="^error: --out .*benchmarks/results/ holds curated results, written only by "
                                         "benchmarks/publish.py; write to a run directory \\(default runs/soak/"):
        run_dir("soak", RESULTS / "sub")


def test_publish_copies_the_json_and_its_png(tmp_path, capsys):
    src = _write(tmp_path / "run", "x_H200x2", GOOD)
    dest = tmp_path / "results"
    assert publish.main([str(src), "--to", str(dest)]) == 0
    assert sorted(p.name for p in dest.iterdir()) == ["x_H200x2.json", "x_H200x2.png"]
    assert json.loads((dest / "x_H200x2.json").read_text()) == GOOD
    assert capsys.readouterr().out.count("published ") == 2


@pytest.mark.parametrize("drop, named", [("commit", "commit"), ("device", "device"), ("overrides", "its settings")])
def test_a_result_without_its_commit_device_or_settings_publishes_nothing(tmp_path, capsys, drop, named):
    good = _write(tmp_path / "run", "a_H200x2", GOOD)
    bad = _write(tmp_path / "run", "b_H200x2", {k: v for k, v in GOOD.items() if k != drop})
    dest = tmp_path / "results"
    assert publish.main([str(good), str(bad), "--to", str(dest)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {bad} records no {named}")
    assert not dest.exists()  # checked before anything is copied: the good one waits too


def test_a_result_of_no_device_needs_the_flag(tmp_path):
    src = _write(tmp_path / "run", "plan", {k: v for k, v in GOOD.items() if k != "device"}, png=False)
    dest = tmp_path / "results"
    assert publish.main([str(src), "--to", str(dest)]) == 2
    assert publish.main([str(src), "--no-device", "--to", str(dest)]) == 0
    assert [p.name for p in dest.iterdir()] == ["plan.json"]


def test_git_commit_reads_the_checkout_or_the_named_commit(tmp_path, monkeypatch):
    """The commit a result records: HEAD's, read from .git (a loose ref, else packed-refs), or $HYBRID_RL_COMMIT
    where the tree's .git is not the checkout's; a tree with neither is ``unknown``."""
    from bench_common import git_commit

    monkeypatch.delenv("HYBRID_RL_COMMIT", raising=False)
    git = tmp_path / "repo" / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "packed-refs").write_text("# pack-refs\n" + "a" * 40 + " refs/heads/main\n")
    assert git_commit(git.parent) == "a" * 12
    (git / "refs" / "heads" / "main").write_text("b" * 40 + "\n")  # a loose ref is newer than the packed one
    assert git_commit(git.parent) == "b" * 12
    monkeypatch.setenv("HYBRID_RL_COMMIT", "c" * 40)
    assert git_commit(git.parent) == "c" * 12
    monkeypatch.delenv("HYBRID_RL_COMMIT")
    assert git_commit(tmp_path / "nothing") == "unknown"
