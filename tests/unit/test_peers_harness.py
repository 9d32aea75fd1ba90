"""The peer benchmark's restart rule (benchmarks/peers/run_verl.py): verl is started again only when its vLLM
servers died of the distributed-init port collision before step 1, not on any other failure."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

import run_verl  # noqa: E402


def test_port_race_is_recognised(tmp_path):
    log = tmp_path / "verl_stdout.log"
    log.write_text("(Worker pid=1) ERROR ... DistNetworkError: ... code: -98, name: EADDRINUSE, message: address already"
                   " in use\nRuntimeError: Engine core initialization failed. See root cause above.\n")
    assert run_verl.port_race(log)


def test_other_failures_are_not_retried(tmp_path):
    log = tmp_path / "verl_stdout.log"
    log.write_text("RuntimeError: Engine core initialization failed. See root cause above.\nCUDA out of memory\n")
    assert not run_verl.port_race(log)
    assert not run_verl.port_race(tmp_path / "missing.log")
