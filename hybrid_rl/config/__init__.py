"""The one config tree: typed dataclasses, YAML loading, dotted overrides, validation.

Every recipe in ``recipes/`` mirrors this tree 1:1: ``Config`` (``tree.py``) holds one section per top-level key,
each a dataclass beside the checks of its own keys (``model.py``, ``rollout.py``, ``actor.py``, ``algorithm.py``,
``trainer.py``, ``env.py``; the actor and the critic share ``update.py``'s optimiser and batch keys; an engine's own options, such
as ``rollout.vllm``, are defined beside that engine). Each field's declaration also says whether a resume may change
it (``fields.py``, read by ``resume.py``); renamed keys are ``moved.py``'s. ``loading.py``
reads recipes and overrides strictly: an unknown key is an error naming its full dotted path and the closest valid
one, a value of the wrong type is an error naming the key and the expected type, a key given twice is an error
naming it and both lines (``strict_yaml.py``). ``Config.validate`` checks each
section, then the facts that span sections (``checks.py``: divisibility of batch sizes, GRPO group sizes), with
messages that say what to change. The choices of an extension point (``algorithm.adv_estimator``,
``rollout.name``) are the names in its registry (``hybrid_rl.registry``), checked like a ``Literal`` when the
value is loaded (``registered.py``), so a registered plug-in (``plugins.py``) is valid config. Validation never
rewrites a value; derived quantities are properties, and the batch geometry of an update is ``geometry.py``'s.
Left out on purpose: Hydra-style interpolation and config composition (one flat YAML per recipe is the whole UI).
"""

from hybrid_rl.config.actor import ActorConfig, CriticConfig, RefConfig
from hybrid_rl.config.algorithm import (AlgorithmConfig, FilterGroupsConfig, KLControlConfig, RewardConfig, RewardModelConfig,
                                        RolloutCorrectionConfig)
from hybrid_rl.config.env import EnvConfig
from hybrid_rl.config.errors import ConfigError
from hybrid_rl.config.geometry import data_parallel_size, lr_schedule_steps, mini_batch_seqs
from hybrid_rl.config.loading import RECIPES_DIR, all_keys, load_config, save_config
from hybrid_rl.config.model import DataConfig, LoraConfig, ModelConfig
from hybrid_rl.config.plugins import import_plugins
from hybrid_rl.config.resume import RESUME_HARMLESS, RESUME_IGNORED, resume_config_diff
from hybrid_rl.config.moved import MOVED_KEYS
from hybrid_rl.config.rollout import RolloutConfig, parse_forced_lengths
from hybrid_rl.config.trainer import TrainerConfig, partial_pool_steps
from hybrid_rl.config.tree import Config
from hybrid_rl.config.update import UpdateConfig
from hybrid_rl.rollout.vllm_options import VLLMOptions

__all__ = [
    "ActorConfig", "AlgorithmConfig", "Config", "ConfigError", "CriticConfig", "DataConfig", "EnvConfig", "FilterGroupsConfig",
    "KLControlConfig", "LoraConfig", "ModelConfig", "MOVED_KEYS", "RECIPES_DIR", "RESUME_HARMLESS", "RESUME_IGNORED",
    "RefConfig", "RewardConfig", "RewardModelConfig", "RolloutConfig", "RolloutCorrectionConfig", "TrainerConfig", "UpdateConfig", "VLLMOptions",
    "all_keys", "data_parallel_size", "import_plugins", "load_config", "lr_schedule_steps", "mini_batch_seqs",
    "parse_forced_lengths", "partial_pool_steps", "resume_config_diff", "save_config",
]
