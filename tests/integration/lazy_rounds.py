"""``python -m hybrid_rl`` with partial rollouts' rounds run lazily (``helpers.LazyExecutor``): a round runs when the
step boundary takes it, so where it is interrupted does not depend on thread timing. For tests that compare two
runs step for step under torchrun (split vs colocated); not a user entry point.

    torchrun --nproc_per_node=2 tests/integration/lazy_rounds.py train RECIPE key=value ...
"""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

from helpers import LazyExecutor  # noqa: E402

from hybrid_rl.modes import overlap as pipeline  # noqa: E402

pipeline.ThreadPoolExecutor = lambda **kw: LazyExecutor()
sys.argv[0] = "hybrid_rl"
runpy.run_module("hybrid_rl", run_name="__main__", alter_sys=True)
