"""The config tree: recipes load, unknown keys get suggestions, bad values get messages that name the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_rl.config import Config, ConfigError, all_keys, load_config, save_config

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_loads_and_validates(recipe):
    cfg = load_config(recipe)
    world = 8 if cfg.trainer.device != "cpu" else 1
    cfg.validate(world_size=world)


def test_recipes_exist():
    assert {p.stem for p in RECIPES} >= {"cpu_successor", "gsm8k_grpo", "gsm8k_grpo_7b"}


def test_overrides_are_typed():
    cfg = load_config(None, ["actor.lr=1e-3", "rollout.n=4", "actor.clip_ratio_c=3", "trainer.logger=[jsonl]",
                             "model.lora.target_modules=q_proj,v_proj", "data.val_path=null"])
    assert cfg.actor.lr == 1e-3 and isinstance(cfg.actor.lr, float)
    assert cfg.rollout.n == 4 and cfg.actor.clip_ratio_c == 3.0
    assert cfg.trainer.logger == ["jsonl"] and cfg.model.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.data.val_path is None


@pytest.mark.parametrize("override, message", [
    ("algorithm.adv_estimatr=grpo", "did you mean 'algorithm.adv_estimator'"),
    ("actor.clip_ratio_hgh=0.3", "did you mean 'actor.clip_ratio_high'"),
    ("algorithm.adv_estimator=grpoo", "not one of"),
    ("rollout.n=four", "rollout.n must be an integer"),
    ("actor.lr=fast", "actor.lr must be a number"),
    ("trainer.val_before_train=maybe", "trainer.val_before_train must be true or false"),
    ("model=3", "'model' must be a section"),
    ("trainer.total_steps", "must look like key.sub=value"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override])


@pytest.mark.parametrize("overrides, message", [
    (["data.train_batch_size=30", "actor.ppo_mini_batch_size=16"], "actor.ppo_mini_batch_size"),
    (["rollout.n=1"], "rollout.n must be >= 2"),
    (["actor.ppo_micro_batch_size_per_device=7"], "ppo_micro_batch_size_per_device"),
    (["actor.clip_ratio_c=0.5"], "actor.clip_ratio_c"),
    (["rollout.temperature=0"], "rollout.val_temperature"),
    (["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=5"], "critic.ppo_mini_batch_size"),
    (["data.train_batch_size=0"], "data.train_batch_size=0 must be a positive"),
    (["trainer.rollout_ranks=-1"], "trainer.rollout_ranks=-1 must be >= 0"),
    (["trainer.stall_dump_s=-5"], "trainer.stall_dump_s=-5.0 must be >= 0"),
    (["trainer.profile_steps=[0]"], "trainer.profile_steps"),
    (["trainer.profile_phases=[update]"], r"^trainer.profile_phases=\[.update.\] needs trainer.profile_steps"),
    (["rollout.vllm.kv_cache_dtype=fp8"], "rollout.vllm.kv_cache_dtype is now rollout.vllm.engine_kwargs.kv_cache_dtype"),
    (["rollout.kv_cache_dtype=fp8"], "rollout.kv_cache_dtype is now rollout.vllm.engine_kwargs.kv_cache_dtype"),
    (["rollout.vllm.reuse_stale_kv=true"], "rollout.vllm.reuse_stale_kv was removed: .* delete the key"),
    (["actor.warmup_steps=5"], "^actor.warmup_steps is now actor.lr_warmup_steps; rename it"),
    (["critic.warmup_steps=5"], "^critic.warmup_steps is now critic.freeze_actor_steps; rename it"),
    (["actor.lr_warmup_steps=-1"], "^actor.lr_warmup_steps=-1 must be >= 0$"),
    (["algorithm.adv_estimator=gae", "critic.lr_warmup_steps=-1"], "^critic.lr_warmup_steps=-1 must be >= 0$"),
    (["algorithm.adv_estimator=gae", "critic.betas=[0.9]"], r"^critic.betas must hold two numbers, got \[0.9\]$"),
])
def test_inconsistent_sizes_are_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides).validate()


def test_a_moved_engine_key_names_its_new_place():
    """The vLLM-only keys are the vLLM engine's own section, ``rollout.vllm``: the old flat spelling says where."""
    for key in ("gpu_memory_utilization", "tensor_parallel_size", "engine_process"):
        with pytest.raises(ConfigError, match=rf"^rollout\.{key} is now rollout\.vllm\.{key};"):
            load_config(None, [f"rollout.{key}=1"])
    cfg = load_config(None, ["rollout.vllm.gpu_memory_utilization=0.3", "rollout.vllm.engine_kwargs.swap_space=4"])
    assert cfg.rollout.vllm.gpu_memory_utilization == 0.3 and cfg.rollout.vllm.engine_kwargs == {"swap_space": 4}
    with pytest.raises(ConfigError, match="rollout.vllm.engine_kwargs must be a mapping"):
        load_config(None, ["rollout.vllm.engine_kwargs=4"])


def test_a_checkpoint_saved_with_the_flat_engine_keys_resumes_under_the_new_ones():
    from hybrid_rl.config import resume_config_diff

    cfg = load_config(None, ["rollout.vllm.tensor_parallel_size=2", "rollout.vllm.engine_kwargs.swap_space=4"])
    saved = cfg.to_dict()
    assert resume_config_diff(saved, cfg) == ([], [])
    del saved["rollout"]["vllm"]
    saved["rollout"]["tensor_parallel_size"] = 2
    strict, _ = resume_config_diff(saved, cfg)
    assert strict == ["rollout.vllm.engine_kwargs (checkpoint: {}, now: {'swap_space': 4})"]


def test_a_checkpoint_saved_with_the_former_warmup_keys_resumes_under_the_new_ones():
    """``actor.warmup_steps`` (the LR warm-up) is ``actor.lr_warmup_steps``, ``critic.warmup_steps`` (the steps the
    actor stays frozen) is ``critic.freeze_actor_steps``: a saved config of either spelling compares at the new key."""
    from hybrid_rl.config import resume_config_diff

    cfg = load_config(None, ["actor.lr_warmup_steps=3", "critic.freeze_actor_steps=2"])
    saved = cfg.to_dict()
    saved["actor"]["warmup_steps"] = saved["actor"].pop("lr_warmup_steps")
    saved["critic"]["warmup_steps"] = saved["critic"].pop("freeze_actor_steps")
    assert resume_config_diff(saved, cfg) == ([], [])
    saved["critic"]["warmup_steps"] = 5  # it froze the actor for 5 steps: a change of what is trained
    assert resume_config_diff(saved, cfg) == (["critic.freeze_actor_steps (checkpoint: 5, now: 2)"], [])


def test_actor_and_critic_share_their_update_keys_and_resume_classes():
    """The optimiser, schedule, batch and offload keys are spelt the same in both sections, with the same default
    except the learning rate, and a resume treats a memory knob as harmless in both and the optimiser as strict."""
    import dataclasses

    from hybrid_rl.config import RESUME_HARMLESS, ActorConfig, CriticConfig

    shared = ["lr", "weight_decay", "betas", "lr_warmup_steps", "lr_scheduler", "min_lr_ratio", "ppo_epochs",
              "ppo_mini_batch_size", "ppo_micro_batch_size_per_device", "use_dynamic_bsz", "max_token_len_per_device",
              "loss_agg_mode", "grad_clip", "param_offload", "optimizer_offload"]
    actor, critic = ActorConfig(), CriticConfig()
    for name in shared:
        assert name in {f.name for f in dataclasses.fields(actor)} & {f.name for f in dataclasses.fields(critic)}
        assert getattr(actor, name) == getattr(critic, name) or name == "lr", name
    assert (actor.lr, critic.lr) == (1e-6, 1e-5)
    for section in ("actor", "critic"):
        for name in ("ppo_micro_batch_size_per_device", "use_dynamic_bsz", "max_token_len_per_device",
                     "param_offload", "optimizer_offload"):
            assert f"{section}.{name}" in RESUME_HARMLESS
        for name in ("lr", "betas", "lr_warmup_steps", "ppo_mini_batch_size", "ppo_epochs", "grad_clip"):
            assert f"{section}.{name}" not in RESUME_HARMLESS
    assert "rollout.vllm.gpu_memory_utilization" in RESUME_HARMLESS  # an engine's options mark their fields too
    assert "rollout.vllm.tensor_parallel_size" not in RESUME_HARMLESS


def test_a_token_budget_leaves_the_micro_batch_size_unchecked():
    """With use_dynamic_bsz the micro-batches are cut by tokens: a sequence count that does not divide the
    mini-batch is unused, not an error (it still is without the budget, above)."""
    for section in ("actor", "critic"):
        base = ["algorithm.adv_estimator=gae"] if section == "critic" else []
        load_config(None, base + [f"{section}.use_dynamic_bsz=true",
                                  f"{section}.ppo_micro_batch_size_per_device=7"]).validate()
        with pytest.raises(ConfigError, match=f"{section}.ppo_micro_batch_size_per_device=7"):
            load_config(None, base + [f"{section}.ppo_micro_batch_size_per_device=7"]).validate()


def test_world_size_divisibility():
    with pytest.raises(ConfigError, match="divisible by the 3 ranks"):
        load_config(None, ["data.train_batch_size=32"]).validate(world_size=3)


def test_missing_recipe_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


@pytest.mark.parametrize("text, key, lines", [
    ("model:\n  path: builtin:tiny-qwen2\nrollout:\n  n: 4\ndata:\n  task: successor\nrollout:\n  n: 8\n",
     "rollout", (3, 7)),
    ("rollout:\n  n: 4\n  temperature: 1.0\n  n: 8\n", "rollout.n", (2, 4)),
    ("rollout:\n  vllm:\n    engine_kwargs: {swap_space: 1, swap_space: 2}\n",
     "rollout.vllm.engine_kwargs.swap_space", (3, 3)),
    ("trainer:\n  logger:\n    - {a: 1}\n    - {a: 1,\n       a: 2}\n", "trainer.logger[1].a", (4, 5)),
], ids=["section", "leaf", "flow mapping", "inside a list"])
def test_a_key_given_twice_is_refused_naming_the_dotted_key_the_file_and_both_lines(tmp_path, text, key, lines):
    recipe = tmp_path / "dup.yaml"
    recipe.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(recipe)
    msg = str(ei.value)
    assert f"'{key}' appears twice (lines {lines[0]} and {lines[1]})" in msg and str(recipe) in msg, msg
    assert "\n" not in msg


def test_merge_keys_may_be_overridden_and_equal_values_elsewhere_are_not_duplicates(tmp_path):
    from hybrid_rl.config.strict_yaml import load_yaml

    assert load_yaml("base: &b {x: 1, y: 2}\nd:\n  <<: *b\n  x: 3\n") == {"base": {"x": 1, "y": 2},
                                                                         "d": {"x": 3, "y": 2}}
    assert load_yaml("a: {n: 1}\nb: {n: 1}\n1: x\n'1': y\n") == {"a": {"n": 1}, "b": {"n": 1}, 1: "x", "1": "y"}


def test_an_override_value_with_a_key_twice_is_refused():
    with pytest.raises(ConfigError, match=r"'rollout\.vllm\.engine_kwargs\.a' is given twice"):
        load_config(None, ["rollout.vllm.engine_kwargs={a: 1, a: 2}"])


def test_vllm_max_model_len_shorter_than_a_prompt_and_its_response_is_refused():
    base = ["rollout.name=vllm", "trainer.device=cuda", "data.max_prompt_length=100", "data.max_response_length=28"]
    load_config(None, base + ["rollout.vllm.max_model_len=128"]).validate()
    with pytest.raises(ConfigError, match=r"rollout.vllm.max_model_len=127 is shorter than data.max_prompt_length \+ "
                                          r"data.max_response_length = 100 \+ 28 = 128: .*at least 128"):
        load_config(None, base + ["rollout.vllm.max_model_len=127"]).validate()


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(ROOT / "recipes" / "cpu_successor.yaml", ["actor.lr=0.5"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg


def test_every_field_has_a_docstring():
    """Convention: a one-line docstring under each field (read from each dataclass's source)."""
    import dataclasses
    import inspect

    import hybrid_rl.config as config_module

    classes = [c for c in vars(config_module).values() if inspect.isclass(c) and dataclasses.is_dataclass(c)]
    assert len(classes) >= 9
    for cls in classes:
        for f in dataclasses.fields(cls):
            # the nearest class that declares it (a section's own, or the UpdateConfig the actor and critic share)
            owner = next(c for c in cls.__mro__ if f.name in vars(c).get("__annotations__", {}))
            lines = inspect.getsource(owner).splitlines()
            i = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{f.name}:"))
            assert lines[i + 1].strip().startswith('"""'), f"{owner.__name__}.{f.name} has no docstring"
    assert len(all_keys()) > 60


def test_cli_reports_unknown_key_and_exits_nonzero():
    proc = subprocess.run([sys.executable, "-m", "hybrid_rl", "train", str(ROOT / "recipes" / "gsm8k_grpo.yaml"),
                           "algorithm.adv_estimatr=grpo"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0
    assert "algorithm.adv_estimator" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_cli_missing_recipe():
    proc = subprocess.run([sys.executable, "-m", "hybrid_rl", "train", "recipes/nope.yaml"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_config_defaults_validate():
    Config().validate()
