"""Parameter offload of an FSDP2 engine after a no-grad pass (the frozen reference's every pass: onload, forward,
offload). FSDP2 keeps the root's parameters gathered after a forward (its embedding, final norm and LM head), for the
backward that a no-grad pass never runs; the offload must give up the sharded parameters, not those gathered copies,
and the host buffer must stay the one it allocated for them.

Runs in a subprocess: one gloo rank, so FSDP2 shards exactly as under torchrun, without a process group left in the
test process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
from hybrid_rl.models import load_causal_lm
from hybrid_rl.workers.fsdp_engine import FrozenReference, TrainingEngine
from hybrid_rl.workers.offload import local
from helpers import fsdp_params

def engine():
    return TrainingEngine(load_causal_lm(sys.argv[1], torch.float32), torch.device("cpu"), torch.float32,
                          trainable=False)

def sharded_bytes(e):  # FSDP2's own sharded parameters, whatever the module holds at the moment
    return sum(local(fp.sharded_param).untyped_storage().nbytes() for fp in fsdp_params(e.model))

ids = torch.tensor([[3, 9, 4, 7, 1, 5]])
torch.manual_seed(0)
plain = engine()
with torch.no_grad():
    want = plain.model(ids).logits
ref = FrozenReference(engine(), offload=True)
full = sharded_bytes(plain)
out = dict(full=full, at_init=sharded_bytes(ref.engine), buffer=ref.engine._host["params"].host_bytes)
ptr = ref.engine._host["params"].buffer.data_ptr()
passes = []
for _ in range(2):
    ref.engine.onload()
    with torch.no_grad():
        got = ref.model(ids).logits
    ref.engine.offload(params=True, optimizer=False)
    passes.append(dict(equal=torch.equal(got, want), left=sharded_bytes(ref.engine),
                       same_buffer=ref.engine._host["params"].buffer.data_ptr() == ptr,
                       buffer=ref.engine._host["params"].host_bytes,
                       gathered=[n for n, p in ref.model.named_parameters() if not hasattr(p, "_local_tensor")]))
out["passes"] = passes
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_a_no_grad_pass_then_offload_frees_every_shard_into_the_same_buffer(tiny_model_path, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model_path, str(tmp_path / "store")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # the tiny model in fp32, each parameter's shard once: 80,896 parameters
    assert out["full"] == 80896 * 4 and out["at_init"] == 0
    for p in out["passes"]:
        assert p["equal"]  # the pass computed with the parameters brought back
        assert p["left"] == 0  # every shard given up, the root's too (not its gathered copy)
        assert p["gathered"] == []  # the module holds its sharded parameters again
        assert p["same_buffer"] and p["buffer"] == out["buffer"]  # no new host buffer for other sizes
