"""Every bad input gets one line naming the key or file and the fix, exit code 2, and no traceback.

The README's "Bad input" table is this list; ``python tests/integration/test_bad_inputs.py`` prints it from real runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/cpu_successor.yaml"
FAST = ["trainer.total_steps=1", "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.logger=[jsonl]"]


def _setup(tmp: Path) -> dict[str, str]:
    bad_rows = tmp / "bad.jsonl"
    bad_rows.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": \n')
    no_field = tmp / "nofield.jsonl"
    no_field.write_text('{"prompt": "1+1?"}\n')
    raising = tmp / "raising_reward.py"
    raising.write_text("def score(response, ground_truth):\n    raise ZeroDivisionError('boom')\n")
    broken = tmp / "broken.yaml"  # a colon inside a value, on line 3
    broken.write_text("model:\n  path: builtin:tiny-qwen2\n  dtype: float32: x\n")
    return {"bad_rows": str(bad_rows), "no_field": str(no_field), "raising": f"{raising}:score", "tmp": str(tmp),
            "broken": str(broken)}


# (what, arguments after `python -m hybrid_rl`, substrings the one-line message must contain)
CASES = [
    ("misspelt key", ["train", "recipes/gsm8k_grpo.yaml", "algorithm.adv_estimatr=grpo"], ["algorithm.adv_estimator"]),
    ("recipe that does not exist", ["train", "recipes/nope.yaml"], ["does not exist", "recipes/"]),
    # `make train RECIPE=nope` runs this: the recipes are listed by the names make takes
    ("make train RECIPE= a name that is no recipe", ["train", "--nproc", "1", "recipes/nope.yaml"],
     ["'recipes/nope.yaml' does not exist", "cpu_successor", "gsm8k_grpo", "make train RECIPE="]),
    ("recipe that is not valid YAML", ["train", "{broken}"],
     ["not valid YAML", "broken.yaml' is not valid YAML: line 3, column 17: mapping values are not allowed here"]),
    ("wrong type", ["train", RECIPE, "rollout.n=many"], ["rollout.n must be an integer"]),
    ("value not in the choices", ["train", RECIPE, "algorithm.adv_estimator=ppo"], ["algorithm.adv_estimator", "grpo"]),
    ("batch not divisible into mini-batches", ["train", RECIPE, "actor.ppo_mini_batch_size=48"], ["actor.ppo_mini_batch_size"]),
    ("GRPO with one sample per prompt", ["train", RECIPE, "rollout.n=1"], ["rollout.n must be >= 2"]),
    ("missing model directory", ["train", RECIPE, "model.path=./no/such/model"], ["model.path", "does not exist"]),
    ("missing data file", ["train", RECIPE, "data.train_path=./no/such/train.jsonl", "data.task=gsm8k"],
     ["no/such/train.jsonl", "data.train_path"]),
    ("malformed dataset row", ["train", RECIPE, "data.train_path={bad_rows}", "data.task=gsm8k", "data.val_path=null"],
     ["bad.jsonl:2"]),
    ("dataset row without the task's field", ["train", RECIPE, "data.train_path={no_field}", "data.task=gsm8k",
                                              "data.val_path=null"], ["question"]),
    ("prompt longer than max_prompt_length", ["train", RECIPE, "data.max_prompt_length=5"], ["data.max_prompt_length"]),
    ("reward function that raises", ["train", RECIPE, "reward.function={raising}", "data.val_path=null"],
     ["ZeroDivisionError", "reward.on_error=zero"]),
    ("reward function that does not exist", ["train", RECIPE, "reward.function=no_such_module:score"], ["reward.function"]),
    ("vLLM requested but not installed", ["train", RECIPE, "rollout.name=vllm"], ["pip install", "rollout.name=hf"]),
    # `make train RECIPE=gsm8k_grpo` on a CPU-only machine: GPUs, and the hub model (rollout.name=hf would only reach
    # the hub's error), and the way to try the product on CPU
    ("vLLM recipe on a machine without GPUs", ["train", "--nproc", "1", "recipes/gsm8k_grpo.yaml"],
     ["needs NVIDIA GPUs and vLLM", "install -e '.[vllm]'", "model.path='Qwen/Qwen2.5-1.5B-Instruct' also needs hub "
      "access or a local copy", "make train"]),
    ("vLLM engine in float32", ["train", RECIPE, "rollout.name=vllm", "rollout.dtype=float32"], ["rollout.dtype=auto"]),
    ("resume from a path that is no checkpoint", ["train", RECIPE, "trainer.resume={tmp}", "trainer.output_dir={tmp}/run"],
     ["trainer.resume", "trainer.resume=auto"]),
    ("export of a missing checkpoint", ["export", "{tmp}/nothing", "{tmp}/out"], ["does not exist"]),
    # preflight (hybrid_rl/preflight.py): caught in seconds, before any model or data loads
    ("hub model, not cached, hub offline", ["train", RECIPE, "model.path=fake-org/fake-model"],
     ["model.path='fake-org/fake-model'", "HF_HUB_OFFLINE", "builtin:tiny-qwen2", "hf download"]),
    ("hub dataset, not cached, hub offline", ["train", RECIPE, "data.train_path=fake-org/fake-data", "data.task=gsm8k"],
     ["data.train_path='fake-org/fake-data'", "HF_HUB_OFFLINE", ".jsonl/.parquet"]),
    ("hub validation set, not cached, hub offline", ["train", RECIPE, "data.val_path=fake-org/fake-data",  # validates
                                                     "trainer.output_dir={tmp}/run_val"], ["data.val_path='fake-org/fake-data'", "HF_HUB_OFFLINE"]),
    ("trainer.device=cuda without a GPU", ["train", RECIPE, "trainer.device=cuda"], ["trainer.device=cpu"]),
]

# environment of a case (formatted like its arguments): an empty Hugging Face cache and no hub
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_HOME": "{tmp}/hf_home"}
ENVS = {"hub model, not cached, hub offline": OFFLINE, "vLLM recipe on a machine without GPUs": OFFLINE, "hub dataset, not cached, hub offline": OFFLINE,
        "hub validation set, not cached, hub offline": OFFLINE}
# a case that needs the machine to lack something
SKIP_IF = {"trainer.device=cuda without a GPU": lambda: __import__("torch").cuda.is_available(),
           "vLLM recipe on a machine without GPUs": lambda: __import__("torch").cuda.is_available()}


def _run(args: list[str], paths: dict[str, str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    args = [a.format(**paths) for a in args]
    env = {**os.environ, **{k: v.format(**paths) for k, v in (env or {}).items()}}
    extra = FAST + [f"trainer.output_dir={paths['tmp']}/run_default"] if args[0] == "train" and not any(
        a.startswith("trainer.output_dir") for a in args) else []
    return subprocess.run([sys.executable, "-m", "hybrid_rl", *args, *extra], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=env)


SLOW = {"malformed dataset row", "dataset row without the task's field", "prompt longer than max_prompt_length",
        "reward function that raises", "reward function that does not exist"}
"""Cases whose error comes only after the model is built and a step has started: left to ``-m slow``."""


@pytest.mark.parametrize("what, args, expected",
                         [pytest.param(*c, marks=pytest.mark.slow) if c[0] in SLOW else c for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line(tmp_path, what, args, expected):
    if what.startswith("vLLM"):
        pytest.importorskip("torch")
        try:
            import vllm  # noqa: F401
            pytest.skip("vllm is installed here")
        except ImportError:
            pass
    if what in SKIP_IF and SKIP_IF[what]():
        pytest.skip("this machine has what the case lacks")
    proc = _run(args, _setup(tmp_path), ENVS.get(what))
    err = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(err) == 1 and len(err[0]) < 600, proc.stderr[-2000:]
    for s in expected:
        assert s in err[0], (s, err[0])


if __name__ == "__main__":  # print the README table from real runs
    import tempfile

    print("| bad input | what `hybrid-rl` (and `make train`) prints (exit code 2) |\n|---|---|")
    with tempfile.TemporaryDirectory() as d:
        paths = _setup(Path(d))
        for what, args, _ in CASES:
            proc = _run(args, paths, ENVS.get(what))
            line = next((l for l in proc.stderr.splitlines() if l.startswith("error:")), proc.stderr.strip()[-200:])
            print(f"| {what} | `{line.replace(d, '/tmp/x').replace('|', '/')}` |")
