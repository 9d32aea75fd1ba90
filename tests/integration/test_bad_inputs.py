"""Every bad input gets one line naming the key or file and the fix, exit code 2, and no traceback.

That line is the last one on stderr (a progress bar drawn before it is closed first, never redrawn after it), and a
refused run leaves no ``trainer.output_dir`` behind. The README's "Bad input" table is this list;
``python tests/integration/test_bad_inputs.py`` prints it from real runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # helpers, also when this file runs as a script
from helpers import unwritable_dir  # noqa: E402

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
    twice = tmp / "twice.yaml"  # the CPU recipe with a second rollout section at its end
    twice.write_text((ROOT / RECIPE).read_text() + "\nrollout:\n  n: 4\n")
    twice_line = twice.read_text().splitlines().index("rollout:", len((ROOT / RECIPE).read_text().splitlines())) + 1
    first_line = (ROOT / RECIPE).read_text().splitlines().index("rollout:") + 1
    (tmp / "empty_model").mkdir(exist_ok=True)
    no_args = tmp / "no_args_reward.py"
    no_args.write_text("def score():\n    return 1.0\n")
    hanging = tmp / "hanging_reward.py"
    hanging.write_text("import time\n\ndef score(response, ground_truth):\n    time.sleep(60)\n    return 1.0\n")
    return {"bad_rows": str(bad_rows), "no_field": str(no_field), "raising": f"{raising}:score", "tmp": str(tmp),
            "broken": str(broken), "twice": str(twice), "twice_lines": f"lines {first_line} and {twice_line}",
            "no_args": f"{no_args}:score", "hanging": f"{hanging}:score"}


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
                                              "data.val_path=null"],
     ["data.train_path='{no_field}': row 1 has no 'question' field, which the gsm8k task needs"]),
    ("validation row without the task's field", ["train", RECIPE, "data.train_path=synthetic:arith", "data.task=arith",
                                                 "data.val_path={no_field}", "trainer.test_freq=1",
                                                 "data.max_prompt_length=160"],
     ["data.val_path='{no_field}': row 1 has no 'question' field, which the arith task needs"]),
    ("prompt longer than max_prompt_length", ["train", RECIPE, "data.max_prompt_length=5"], ["data.max_prompt_length"]),
    # with the progress bar drawn: the error still ends stderr, on a line of its own
    ("reward function that raises", ["train", RECIPE, "reward.function={raising}", "data.val_path=null",
                                     "trainer.logger=[console,jsonl]"],
     ["reward.function='{raising}' failed on sample", "ZeroDivisionError", "reward.on_error=zero"]),
    ("reward function past reward.timeout_s", ["train", RECIPE, "reward.function={hanging}", "reward.timeout_s=1",
                                               "reward.num_workers=1", "data.val_path=null",
                                               "trainer.logger=[console,jsonl]"],
     ["reward.function='{hanging}' did not return within reward.timeout_s=1", "raise reward.timeout_s"]),
    ("reward function that takes no arguments", ["train", RECIPE, "reward.function={no_args}"],
     ["reward.function='{no_args}': score() cannot be called as score(response, ground_truth)",
      "def score(response, ground_truth)"]),
    ("reward function that does not exist", ["train", RECIPE, "reward.function=no_such_module:score"], ["reward.function"]),
    ("reward model that is a causal LM", ["train", RECIPE, "reward.model.path=builtin:tiny-qwen2"],
     ["reward.model.path='builtin:tiny-qwen2' is a Qwen2ForCausalLM, not a reward model", "builtin:tiny-qwen2-rm"]),
    ("reward model path that does not exist", ["train", RECIPE, "reward.model.path=./no/such/rm"],
     ["reward.model.path: './no/such/rm' does not exist"]),
    ("chat prompts with nothing to score them", ["train", RECIPE, "data.task=chat", "data.train_path={no_field}",
                                                  "data.val_path=null"], ["data.task=chat", "reward.model.path"]),
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
    ("recipe with a key given twice", ["train", "{twice}"],
     ["recipe '{twice}': key 'rollout' appears twice ({twice_lines})", "keep one"]),
    ("model.path an empty directory", ["train", RECIPE, "model.path={tmp}/empty_model"],
     ["model.path='{tmp}/empty_model': the directory has no config.json (it is empty)", "builtin:tiny-qwen2"]),
    ("prompt + response longer than the model's positions", ["train", RECIPE, "data.max_response_length=100000"],
     ["data.max_prompt_length + data.max_response_length = 32 + 100000", "the 512 positions of",
      "lower data.max_response_length to at most 480"]),
    ("rollout.vllm.max_model_len shorter than a prompt and its response",
     ["train", RECIPE, "rollout.name=vllm", "rollout.vllm.max_model_len=16"],
     ["rollout.vllm.max_model_len=16 is shorter than data.max_prompt_length + data.max_response_length = 32 + 4",
      "at least 36"]),
    ("built-in model cache that cannot be written", ["train", RECIPE],
     ["the cache {tmp}/locked_cache ($HYBRID_RL_CACHE) is not writable", "point HYBRID_RL_CACHE at a directory"]),
]

ABSENT = {"dataset row without the task's field": ["data.val_path"],
          "validation row without the task's field": ["data.train_path"],
          "built-in model cache that cannot be written": ["free space"]}
"""Words a case's line must not hold (the other key, a fix that is not this one's)."""

# environment of a case (formatted like its arguments): an empty Hugging Face cache and no hub
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_HOME": "{tmp}/hf_home"}
ENVS = {"hub model, not cached, hub offline": OFFLINE, "vLLM recipe on a machine without GPUs": OFFLINE, "hub dataset, not cached, hub offline": OFFLINE,
        "hub validation set, not cached, hub offline": OFFLINE,
        "built-in model cache that cannot be written": {"HYBRID_RL_CACHE": "{tmp}/locked_cache"}}
# what a case needs around its run (given the paths of ``_setup``)
AROUND = {"built-in model cache that cannot be written": lambda paths: unwritable_dir(Path(paths["tmp"]) / "locked_cache")}
# a case that needs the machine to lack something
SKIP_IF = {"trainer.device=cuda without a GPU": lambda: __import__("torch").cuda.is_available(),
           "vLLM recipe on a machine without GPUs": lambda: __import__("torch").cuda.is_available()}


def _command(args: list[str], paths: dict[str, str]) -> list[str]:
    """The case's arguments; for a ``train`` case that names no ``trainer.output_dir``, then ``FAST`` (less the keys
    the case sets) and a fresh one."""
    args = [a.format(**paths) for a in args]
    given = {a.split("=", 1)[0] for a in args}
    if args[0] != "train" or "trainer.output_dir" in given:
        return args
    extra = [a for a in FAST + [f"trainer.output_dir={paths['tmp']}/run_default"] if a.split("=", 1)[0] not in given]
    return args + extra


def _run(args: list[str], paths: dict[str, str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **{k: v.format(**paths) for k, v in (env or {}).items()}}
    return subprocess.run([sys.executable, "-m", "hybrid_rl", *_command(args, paths)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env=env)


def _output_dir(args: list[str], paths: dict[str, str]) -> Path | None:
    dirs = [a.split("=", 1)[1] for a in _command(args, paths) if a.startswith("trainer.output_dir=")]
    return Path(dirs[-1]) if dirs else None


SLOW = {"malformed dataset row", "dataset row without the task's field", "validation row without the task's field",
        "prompt longer than max_prompt_length", "reward function that raises", "reward function past reward.timeout_s"}
"""Cases whose error comes only after the model is built and a step has started: left to ``-m slow``."""
IN_A_STEP = {"reward function that raises", "reward function past reward.timeout_s"}
"""Cases refused in a step, not before: the run has started, and its directory (config, metrics) stays."""


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
    paths = _setup(tmp_path)
    with AROUND.get(what, lambda paths: nullcontext())(paths):
        proc = _run(args, paths, ENVS.get(what))
    err = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(err) == 1 and len(err[0]) < 600, proc.stderr[-2000:]
    for s in expected:
        assert s.format(**paths) in err[0], (s.format(**paths), err[0])
    for s in ABSENT.get(what, []):
        assert s not in err[0], (s, err[0])
    # the terminal's last line is the error, whole: no progress bar drawn after it, nor before it on its line
    assert proc.stderr.rstrip("\n").rsplit("\n", 1)[-1] == err[0], proc.stderr[-2000:]
    out = _output_dir(args, paths)
    if what not in IN_A_STEP:  # a run refused before its first step leaves no directory
        assert out is None or not out.exists(), sorted(p.name for p in out.iterdir())


if __name__ == "__main__":  # print the README table from real runs
    import tempfile

    print("| bad input | what `hybrid-rl` (and `make train`) prints (exit code 2) |\n|---|---|")
    with tempfile.TemporaryDirectory() as d:
        paths = _setup(Path(d))
        for what, args, _ in CASES:
            try:
                with AROUND.get(what, lambda paths: nullcontext())(paths):
                    proc = _run(args, paths, ENVS.get(what))
            except pytest.skip.Exception as e:  # this machine cannot set the case up
                print(f"| {what} | (not run here: {e}) |")
                continue
            line = next((l for l in proc.stderr.splitlines() if l.startswith("error:")), proc.stderr.strip()[-200:])
            print(f"| {what} | `{line.replace(d, '/tmp/x').replace('|', '/')}` |")
