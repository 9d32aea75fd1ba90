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


CHILD = ("import os, subprocess, sys; print(os.getpid(), os.environ['VLLM_PORT']); sys.stdout.flush(); "
         "subprocess.run([sys.executable, '-c', 'import os; print(os.getpid(), os.environ[\\'VLLM_PORT\\'])'])")


def _vllm_port(site, env_port=None):
    """(pid, VLLM_PORT) of a process started with the port site, then of a child it starts."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PORT", "HYBRID_RL_PEERS_VLLM_PORT")}
    env["PYTHONPATH"] = str(site)
    if env_port:
        env["VLLM_PORT"] = env_port
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    return (int(out[0]), int(out[1])), (int(out[2]), int(out[3]))


def test_port_site_gives_each_process_its_own_vllm_port(tmp_path):
    site = run_verl.port_site(tmp_path)
    # a child gets its own base, not its parent's (an inherited base made every vLLM engine core collide)
    (pid_a, a), (pid_b, b) = _vllm_port(site)
    assert a == 20000 + (pid_a % 2000) * 16 and b == 20000 + (pid_b % 2000) * 16
    assert 20000 <= min(a, b) and max(a, b) < 20000 + 2000 * 16 < 65536
    if pid_a % 2000 != pid_b % 2000:
        assert abs(a - b) >= 16
    assert [p for _, p in _vllm_port(site, "31000")] == [31000, 31000]  # the user's own VLLM_PORT is kept


def test_peers_prompts_scale_the_step_and_mini_batch():
    from workload import WORKLOAD, scale_batch

    assert scale_batch(WORKLOAD, None) is WORKLOAD
    two_gpus = scale_batch(WORKLOAD, "32")
    assert (two_gpus["prompts_per_step"], two_gpus["mini_batch_prompts"]) == (32, 16)
    assert {k: v for k, v in two_gpus.items() if "prompts" not in k} == {k: v for k, v in WORKLOAD.items()
                                                                        if "prompts" not in k}
    import pytest

    for bad in ("x", "7", "0"):
        with pytest.raises(SystemExit, match="PEERS_PROMPTS"):
            scale_batch(WORKLOAD, bad)


def test_report_refuses_results_of_different_workloads(tmp_path):
    import json

    import plot
    from workload import WORKLOAD, scale_batch

    for name, w in (("hybrid_rl", WORKLOAD), ("verl", scale_batch(WORKLOAD, "32"))):
        (tmp_path / f"{name}.json").write_text(json.dumps({"framework": name, "step_s": 1.0, "workload": w,
                                                           "device": "H200x2", "machine": "a"}))
    import pytest

    with pytest.raises(SystemExit, match="different workloads"):
        plot.combine(tmp_path)
    (tmp_path / "verl.json").write_text(json.dumps({"framework": "verl", "step_s": 2.0, "workload": WORKLOAD,
                                                    "device": "H200x2", "machine": "a"}))
    doc = plot.combine(tmp_path)
    assert doc["ratios"]["hybrid_rl_vs_verl_step_time"] == 2.0 and doc["same_machine"]
