"""Multi-rank invariants of the hybrid engine, measured under torchrun and asserted by ``tests/engine/test_multirank.py``.

    torchrun --standalone --nproc_per_node=2 tests/engine/multirank/checks.py OUT_DIR    # FSDP2 on 2 gloo ranks
    python tests/engine/multirank/checks.py OUT_DIR --single                            # the single-process reference
    MULTIRANK_DEVICE=cuda torchrun --standalone --nproc_per_node=2 tests/engine/multirank/checks.py OUT_DIR  # 2 GPUs, bf16

Every rank writes ``OUT_DIR/rank{r}.pt`` (``single.pt`` for the reference): a
dict of named measurements. The script records instead of asserting, so a
failing invariant shows up in pytest as the one test that names it. Both modes
build the same global batch from the same seed with a plain (unsharded) model,
so the two runs start from bit-identical inputs; each rank of the 2-rank run
trains on its half of it, as the driver would hand it out.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout, without installing

from hybrid_rl.algorithms import logprobs_from_logits  # noqa: E402
from hybrid_rl.batch import Batch  # noqa: E402
from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.data import collate_prompts  # noqa: E402
from hybrid_rl.distributed import DistInfo, destroy, init_distributed  # noqa: E402
from hybrid_rl.models import load_causal_lm, load_tokenizer  # noqa: E402
from hybrid_rl.phases.advantage import compute_advantage  # noqa: E402
from hybrid_rl.phases.reward import sparse_scores  # noqa: E402
from hybrid_rl.phases.old_log_prob import plan_old_log_prob  # noqa: E402
from hybrid_rl.rollout.base import assemble_rollout  # noqa: E402
from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker  # noqa: E402
from hybrid_rl.workers.critic import CriticWorker  # noqa: E402

DEVICE = os.environ.get("MULTIRANK_DEVICE", "cpu")
# MULTIRANK_DTYPE=bfloat16 on CPU runs FSDP2's mixed precision (bf16 compute, fp32 masters and reduction) on gloo
DTYPE = os.environ.get("MULTIRANK_DTYPE", "float32" if DEVICE == "cpu" else "bfloat16")
BASE = [f"trainer.device={DEVICE}", f"model.dtype={DTYPE}", "rollout.n=2", "data.train_batch_size=4", "data.max_response_length=5",
        "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_device=2",
        "actor.log_prob_micro_batch_size_per_device=3", "ref.log_prob_micro_batch_size_per_device=3",
        "actor.lr=1e-3", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.05", "actor.entropy_coeff=0.01",
        "trainer.logger=[jsonl]"]
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,v_proj]", "actor.lr=1e-2"]
TEXTS = ("7", "Hello there, 12+5=?", "3", "a longer prompt with several words")


# --------------------------------------------------------------------------- inputs
def make_batch(worker: ActorRolloutRefWorker, seed: int) -> Batch:
    """A scored rollout batch of 4 prompts × n=2, built without the worker's engines (identical in every process)."""
    tok = worker.tokenizer
    items = [dict(input_ids=tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False),
                  ground_truth="8", data_source="successor", index=i) for i, t in enumerate(TEXTS)]
    prompts = collate_prompts(items, tok.pad_token_id)
    g = torch.Generator().manual_seed(seed)
    n, width = worker.cfg.rollout.n, worker.cfg.data.max_response_length
    responses = torch.randint(3, len(tok), (len(items) * n, width), generator=g)
    responses[1, 2] = tok.eos_token_id  # one response stops early: masks matter
    batch = assemble_rollout(prompts, responses, torch.zeros(responses.shape), n, [tok.eos_token_id], tok.pad_token_id)
    model = load_causal_lm(worker.cfg.model.path, torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], use_cache=False).logits
        lp = logprobs_from_logits(logits[:, -width - 1:-1].float(), batch["responses"])
    mask = batch["response_mask"].float()
    noise = torch.randn(lp.shape, generator=g)
    adv = torch.randn(len(batch), 1, generator=g).expand_as(lp) * mask
    return batch.union(tensors=dict(old_log_probs=(lp + 0.1 * noise) * mask, rollout_log_probs=(lp + 0.05 * noise) * mask,
                                    ref_log_prob=(lp - 0.02 * noise.abs()) * mask, advantages=adv.contiguous(),
                                    weight_version=torch.zeros(len(batch), dtype=torch.long)),
                       temperature=1.0, weight_version=0)


def local_share(batch: Batch, d: DistInfo) -> Batch:
    per = len(batch) // d.world_size
    return batch.index(slice(d.rank * per, (d.rank + 1) * per))


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if hasattr(p, "to_local") else p).detach()


def actor_full_params(worker, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    return {n: full(p).to(dtype or p.dtype) for n, p in worker.actor.model.named_parameters()}


def adam_exp_avg(worker) -> dict[str, torch.Tensor]:
    opt = worker.actor.optimizer
    return {n: full(opt.state[p]["exp_avg"]) for n, p in worker.actor.model.named_parameters() if p in opt.state}


def record_pushes(worker) -> list[tuple[str, torch.dtype]]:
    """Wrap the engine's load_weights to log every (name, dtype) it receives."""
    log: list[tuple[str, torch.dtype]] = []
    engine = worker.rollout
    original = engine.load_weights

    def load_weights(weights):
        weights = list(weights)
        log.extend((n, t.dtype) for n, t in weights)
        return original(weights)

    engine.load_weights = load_weights
    return log


def engine_mismatches(worker, expected: dict[str, torch.Tensor]) -> list[str]:
    # compared on the host: outside rollout_mode a sleeping engine may hold its weights there
    engine = {n: t.cpu() for n, t in worker.rollout.named_weights()}
    bad = [n for n, t in expected.items() if n not in engine or not torch.equal(engine[n], t.cpu())]
    return bad + [n for n in engine if n not in expected]


# --------------------------------------------------------------------------- runs
def run_single(out: Path) -> None:
    d = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    w = ActorRolloutRefWorker(load_config(None, BASE).validate(1), d)
    batch = make_batch(w, seed=0)
    res = {"log_probs": w.compute_log_prob(batch)["old_log_probs"], "ref_log_probs": w.compute_ref_log_prob(batch)["ref_log_prob"]}
    stats = w.update_actor(batch)
    res.update(params_after=actor_full_params(w), exp_avg=adam_exp_avg(w), grad_norm=stats["actor/grad_norm"][0])
    torch.save(res, out / "single.pt")


def run_full_finetune(d: DistInfo, res: dict) -> None:
    w = ActorRolloutRefWorker(load_config(None, BASE).validate(d.world_size), d)
    batch, batch2 = make_batch(w, seed=0), make_batch(w, seed=1)
    res["log_probs"] = w.compute_log_prob(batch)["old_log_probs"]
    res["ref_log_probs"] = w.compute_ref_log_prob(batch)["ref_log_prob"]
    stats = w.update_actor(local_share(batch, d))
    res.update(params_after=actor_full_params(w), exp_avg=adam_exp_avg(w), grad_norm=stats["actor/grad_norm"][0])
    res["ref_log_probs_after_update"] = w.compute_ref_log_prob(batch)["ref_log_prob"]

    # the push: engine == gathered actor, bit for bit, tied weight once, byte count
    log = record_pushes(w)
    with torch.no_grad():  # make sure the push really overwrote everything
        for p in w.rollout.model.parameters():
            p.add_(1.0)
    expected = actor_full_params(w, w.dtype)  # the engine's dtype: the cast commutes with the gather
    sm = w.sharding_manager
    with w.rollout_mode():
        res["engine_mismatches"] = engine_mismatches(w, expected)
        res["tied_ok"] = torch.equal(w.rollout.model.lm_head.weight, expected["model.embed_tokens.weight"])
        gen = w.generate(local_share(batch, d).select(["input_ids", "attention_mask"]).index(slice(0, 1)))
        res["generated"] = tuple(gen["responses"].shape)
    res["pushed"] = list(log)
    res["push_bytes"], res["push_tensors"] = sm.last_sync_bytes, sm.last_sync_tensors
    res["expected_bytes"] = sum(t.numel() * t.element_size() for t in expected.values())
    with w.rollout_mode():
        pass
    res["repeat_push_bytes"] = sm.last_sync_bytes
    w.update_actor(local_share(batch2, d))
    res["twin_params"] = {n: local(p).clone() for n, p in w.actor.model.named_parameters()}


class _CountCollectives:
    """Counts FSDP2's all-gathers and reduce-scatters (whichever names this torch calls) while active."""

    NAMES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")

    def __init__(self):
        self.counts = {"all_gather": 0, "reduce_scatter": 0}
        self._saved = {}

    def __enter__(self):
        for name in self.NAMES:
            fn = getattr(torch.distributed, name, None)
            if fn is None:
                continue
            self._saved[name] = fn
            kind = "all_gather" if name.startswith("all_gather") else "reduce_scatter"

            def counted(*args, _fn=fn, _kind=kind, **kwargs):
                self.counts[_kind] += 1
                return _fn(*args, **kwargs)
            setattr(torch.distributed, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(torch.distributed, name, fn)


def _off_and_on(d: DistInfo, key: str):
    """(flag, a fresh worker with ``key`` set to it, its batch) for the flag off and then on."""
    for flag in (False, True):
        w = ActorRolloutRefWorker(load_config(None, BASE + [f"{key}={str(flag).lower()}"]).validate(d.world_size), d)
        yield flag, w, make_batch(w, seed=0)


def run_accumulate_unsharded(d: DistInfo, res: dict) -> None:
    """The same update as run_full_finetune's, with parameters gathered once per pass (actor.accumulate_unsharded)."""
    results = {}
    for flag, w, batch in _off_and_on(d, "actor.accumulate_unsharded"):
        with _CountCollectives() as c_lp:
            lp = w.compute_log_prob(batch)["old_log_probs"]
        with _CountCollectives() as c_ref:
            ref_lp = w.compute_ref_log_prob(batch)["ref_log_prob"]
        with _CountCollectives() as c_up:
            w.update_actor(local_share(batch, d))
        results[flag] = dict(log_probs=lp, params=actor_full_params(w), log_prob_counts=c_lp.counts,
                             ref_log_probs=ref_lp, ref_counts=c_ref.counts,
                             update_counts=c_up.counts, unsharded_after=[
                                 n for n, p in w.actor.model.named_parameters() if type(p).__name__ != "DTensor"],
                             ref_unsharded_after=[
                                 n for n, p in w.ref.model.named_parameters() if type(p).__name__ != "DTensor"])
    res["unsharded"] = results


def run_critic_unsharded(d: DistInfo, res: dict) -> None:
    """The critic's value pass and two updates with its parameters gathered once per pass (critic.accumulate_unsharded)
    and without; the collectives of the second step's passes are counted (the first moves the zero-initialised value
    head, so that the second's gradients reach every block)."""
    critic_keys = ["algorithm.adv_estimator=gae", "critic.lr=1e-3", "critic.ppo_mini_batch_size=4",
                   "critic.ppo_micro_batch_size_per_device=2", "critic.forward_micro_batch_size_per_device=3"]
    results = {}
    for flag in (False, True):
        cfg = load_config(None, BASE + critic_keys + [f"critic.accumulate_unsharded={str(flag).lower()}"]
                          ).validate(d.world_size)
        critic = CriticWorker(cfg, d)
        maker = type("Maker", (), {"cfg": cfg, "tokenizer": load_tokenizer(cfg.model.path)})()
        batch = local_share(make_batch(maker, seed=0), d)
        scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
        batch = batch.union(tensors=dict(token_level_scores=sparse_scores(scores, batch["response_mask"])))
        critic.update_critic(compute_advantage(critic.compute_values(batch), cfg.algorithm)[0])
        with _CountCollectives() as c_values:
            scored = critic.compute_values(batch)
        with _CountCollectives() as c_update:
            stats = critic.update_critic(compute_advantage(scored, cfg.algorithm)[0])
        results[flag] = dict(values=scored["values"], values_counts=c_values.counts, update_counts=c_update.counts,
                             params={n: full(p) for n, p in critic.model.named_parameters()},
                             grad_norm=stats["critic/grad_norm"][0],
                             unsharded_after=[n for n, p in critic.model.named_parameters()
                                              if type(p).__name__ != "DTensor"])
    res["critic_unsharded"] = results


def run_packed(d: DistInfo, res: dict) -> None:
    """The same log-probs and update padded and packed (actor.use_remove_padding + actor.fused_logprob) on FSDP2."""
    results = {}
    for flag in (False, True):
        keys = [f"actor.use_remove_padding={str(flag).lower()}", f"actor.fused_logprob={str(flag).lower()}"]
        w = ActorRolloutRefWorker(load_config(None, BASE + keys).validate(d.world_size), d)
        batch = make_batch(w, seed=0)
        lp = w.compute_log_prob(batch)["old_log_probs"] * batch["response_mask"]
        stats = w.update_actor(local_share(batch, d))
        results[flag] = dict(log_probs=lp, params=actor_full_params(w), grad_norm=stats["actor/grad_norm"][0])
    res["packed"] = results


def run_shared_prompts(d: DistInfo, res: dict) -> None:
    """The same log-probs and update with prompt-shared packing (actor.share_prompts) as packed without, on FSDP2."""
    results = {}
    for flag in (False, True):
        keys = ["actor.use_remove_padding=true", "actor.fused_logprob=true", f"actor.share_prompts={str(flag).lower()}"]
        w = ActorRolloutRefWorker(load_config(None, BASE + keys).validate(d.world_size), d)
        batch = make_batch(w, seed=0)
        lp = w.compute_log_prob(batch)["old_log_probs"] * batch["response_mask"]
        stats = w.update_actor(local_share(batch, d))
        results[flag] = dict(log_probs=lp, params=actor_full_params(w), grad_norm=stats["actor/grad_norm"][0],
                             token_share=stats.get("perf/update_token_share"))
    res["shared"] = results


def run_own_old(d: DistInfo, res: dict) -> None:
    """``actor.old_log_prob=auto`` on FSDP2: the update with its first mini-batch's π_old from its own forward gives
    the pass's log-probs and lands where the pass followed by the update lands, with one mini-batch (no pass) and
    with two (the pass over the second only)."""
    for name, extra in (("own_old", []), ("own_old_two_mini", ["actor.ppo_mini_batch_size=2"])):
        results = {}
        for own in (False, True):
            w = ActorRolloutRefWorker(load_config(None, BASE + extra).validate(d.world_size), d)
            batch = w.compute_log_prob(make_batch(w, seed=0))  # the pass's π_old instead of make_batch's noisy one
            share = local_share(batch, d)
            if own:
                bare = Batch({k: v for k, v in share.tensors.items() if k not in ("old_log_probs", "old_entropy")},
                             share.non_tensors, share.meta)
                plan = plan_old_log_prob(w.cfg, w, bare, actor_updates=True)
                bare = w.compute_old_log_probs(bare, plan)
                stats, share = w.update_policy(bare, plan)
            else:
                stats = w.update_actor(share)
            results[own] = dict(log_probs=share["old_log_probs"] * share["response_mask"], params=actor_full_params(w),
                                grad_norm=stats["actor/grad_norm"][0], mini_batches=w.num_mini_batches(share))
        res[name] = results


def run_compile(d: DistInfo, res: dict) -> None:
    """The same log-probs and update with the actor's decoder blocks under torch.compile (actor.use_torch_compile)."""
    results = {}
    for flag, w, batch in _off_and_on(d, "actor.use_torch_compile"):
        before = actor_full_params(w)
        lp = w.compute_log_prob(batch)["old_log_probs"]
        w.update_actor(local_share(batch, d))
        lp_after = w.compute_log_prob(batch)["old_log_probs"]
        compiled = [type(m).__name__ for m in w.actor.model.modules() if "forward" in vars(m)]  # set on the instance
        results[flag] = dict(log_probs=lp, log_probs_after=lp_after, params=actor_full_params(w), compiled=compiled,
                             params_before=before)
    res["compile"] = results


def run_offload(d: DistInfo, res: dict) -> None:
    cfg = load_config(None, BASE + ["actor.param_offload=true", "actor.optimizer_offload=true", "ref.offload=true"])
    w = ActorRolloutRefWorker(cfg.validate(d.world_size), d)
    batch, batch2 = make_batch(w, seed=0), make_batch(w, seed=1)
    w.update_actor(local_share(batch, d))
    named = dict(w.actor.model.named_parameters())
    res["offload_grads_after_update"] = [n for n, p in named.items() if p.grad is not None]  # the step frees them
    snap = {n: (local(p).clone(), local(p.grad).clone() if p.grad is not None else None) for n, p in named.items()}
    opt = {n: {k: local(v).clone() for k, v in w.actor.optimizer.state[p].items()} for n, p in named.items()}
    def device_bytes() -> int:  # the actor's parameters, gradients and optimizer state on its device, each storage once
        tensors = [t for p in named.values() for t in (p, p.grad) if t is not None]
        tensors += [v for st in w.actor.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return sum({(s.data_ptr(), s.device): s.nbytes() for s in (local(t).untyped_storage() for t in tensors)
                    if s.device == w.device}.values())

    res["offload_device_bytes_before"] = device_bytes()
    cuda_mem = (lambda: torch.cuda.memory_allocated(w.device)) if DEVICE == "cuda" else (lambda: 0)
    res["offload_mem_before"] = cuda_mem()
    with w.rollout_mode():
        res["offloaded_inside"] = w.actor.params_offloaded and w.actor.optimizer_offloaded
        res["offload_mem_inside"] = cuda_mem()
        res["offload_device_bytes_inside"] = device_bytes()  # every storage freed in place
        res["offload_host_bytes"] = sum(m.host_bytes for m in w.actor._host.values())
    # the parameters come back with the switch; the optimizer state stays offloaded until the update brings it
    res["params_back_optimizer_away_after"] = not w.actor.params_offloaded and w.actor.optimizer_offloaded
    w.actor.onload(params=False, optimizer=True)  # as the update does, to read the state below
    res["offload_param_mismatches"] = [n for n, (v, g) in snap.items()
                                       if not torch.equal(local(named[n]), v)
                                       or (g is not None) != (named[n].grad is not None)
                                       or (g is not None and not torch.equal(local(named[n].grad), g))]
    res["offload_optim_mismatches"] = [f"{n}.{k}" for n, st in opt.items() for k, v in st.items()
                                       if not torch.equal(local(w.actor.optimizer.state[named[n]][k]).to(v.device), v)]
    res["offload_ref_log_probs"] = w.compute_ref_log_prob(batch)["ref_log_prob"]  # onload → forward → offload
    w.update_actor(local_share(batch2, d))  # FSDP state still sound after the round trips (the update onloads)
    res["offload_params"] = {n: local(p).clone() for n, p in w.actor.model.named_parameters()}


def run_lora(d: DistInfo, res: dict) -> None:
    w = ActorRolloutRefWorker(load_config(None, BASE + LORA).validate(d.world_size), d)
    batch = make_batch(w, seed=0)
    model, opt = w.actor.model, w.actor.optimizer
    named = dict(model.named_parameters())
    res["lora_trainable"] = sorted(n for n, p in named.items() if p.requires_grad)
    res["lora_optimizer_params"] = sum(len(g["params"]) for g in opt.param_groups)
    res["lora_all_params"] = len(named)
    base_before = {n: local(p).clone() for n, p in named.items() if not p.requires_grad}
    adapters_before = {n: full(p) for n, p in named.items() if p.requires_grad}
    res["lora_ref_before"] = w.compute_ref_log_prob(batch)["ref_log_prob"]
    res["lora_actor_before"] = w.compute_log_prob(batch)["old_log_probs"]
    log = record_pushes(w)
    sm = w.sharding_manager
    with w.rollout_mode():
        pass
    res["lora_push1"] = (sm.last_sync_bytes, sm.last_sync_tensors, list(log))
    for seed in (0, 1):
        w.update_actor(local_share(make_batch(w, seed=seed), d))
    log.clear()
    with w.rollout_mode():
        pass
    res["lora_push2"] = (sm.last_sync_bytes, sm.last_sync_tensors, list(log))
    # expected engine state: base weights untouched, targeted linears merged W + scale·B@A
    from peft.tuners.lora import LoraLayer

    expected = {n.replace("base_model.model.", "").replace("base_layer.", ""): full(p).to(w.dtype)
                for n, p in named.items() if "lora_" not in n}
    merged = []
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):  # W + scale·B@A (fp32 adapters; a no-op cast on CPU)
            key = name.replace("base_model.model.", "") + ".weight"
            a, b = full(m.lora_A["default"].weight).float(), full(m.lora_B["default"].weight).float()
            expected[key] = (expected[key].float() + (b @ a) * m.scaling["default"]).to(w.dtype)
            merged.append(key)
    res["lora_merged_names"] = merged
    res["lora_engine_mismatches"] = engine_mismatches(w, expected)
    res["lora_base_changed"] = [n for n, v in base_before.items() if not torch.equal(local(named[n]), v)]
    res["lora_adapters_changed"] = [n for n, v in adapters_before.items() if not torch.equal(full(named[n]), v)]
    res["lora_adapters"] = list(adapters_before)
    res["lora_ref_after"] = w.compute_ref_log_prob(batch)["ref_log_prob"]
    res["lora_actor_after"] = w.compute_log_prob(batch)["old_log_probs"]
    # an engine that discarded its weights (sleep level 2) gets everything again
    sm.sleep_level = 2
    with w.rollout_mode():
        pass
    with w.rollout_mode():
        res["lora_after_discard_mismatches"] = engine_mismatches(w, expected)
    res["lora_push_after_discard"] = sm.last_sync_bytes
    res["lora_full_bytes"] = sum(t.numel() * t.element_size() for t in expected.values())
    # a bf16 push from fp32 masters: base cast before the gather, adapters gathered in fp32, merged, cast once
    bf16 = {n: full(p).to(torch.bfloat16) for n, p in named.items() if "lora_" not in n}
    bf16 = {n.replace("base_model.model.", "").replace("base_layer.", ""): t for n, t in bf16.items()}
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            key = name.replace("base_model.model.", "") + ".weight"
            a, b = full(m.lora_A["default"].weight).float(), full(m.lora_B["default"].weight).float()
            bf16[key] = (bf16[key].float() + (b @ a) * m.scaling["default"]).to(torch.bfloat16)
    pushed = dict(w.actor.iter_full_params(torch.bfloat16))
    res["lora_bf16_mismatches"] = [n for n in bf16 if not torch.equal(pushed[n], bf16[n])] + sorted(set(pushed) - set(bf16))


def merged_engine_weights(worker) -> dict[str, torch.Tensor]:
    """What the engine must hold for a (LoRA) actor: W + scale·B@A for targeted linears, W elsewhere."""
    from peft.tuners.lora import LoraLayer

    model = worker.actor.model
    expected = {n.replace("base_model.model.", "").replace("base_layer.", ""): full(p).to(worker.dtype)
                for n, p in model.named_parameters() if "lora_" not in n}
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            key = name.replace("base_model.model.", "") + ".weight"
            a, b = full(m.lora_A["default"].weight).float(), full(m.lora_B["default"].weight).float()
            expected[key] = (expected[key].float() + (b @ a) * m.scaling["default"]).to(worker.dtype)
    return expected


def run_replay(d: DistInfo, res: dict) -> None:
    """Pushes after the first replay the recorded copies (full fine-tuning, then LoRA): the engine still equals the actor."""
    for tag, extra, expected_fn in (("full", [], lambda w: actor_full_params(w, w.dtype)),
                                     ("lora", LORA, merged_engine_weights)):
        w = ActorRolloutRefWorker(load_config(None, BASE + extra).validate(d.world_size), d)
        sm = w.sharding_manager
        mismatches, counts = [], []
        for step in range(3):
            with w.rollout_mode():
                mismatches.append(engine_mismatches(w, expected_fn(w)))
            counts.append((sm.last_sync_tensors, sm.last_sync_replayed))
            w.update_actor(local_share(make_batch(w, seed=step), d))
        res[f"replay_{tag}_mismatches"] = mismatches
        res[f"replay_{tag}_counts"] = counts
        res[f"replay_{tag}_stats"] = vars(sm.replayer.stats).copy()


def run_uneven_shards(d: DistInfo, res: dict) -> None:
    """Parameters with fewer rows than ranks (a rank holds none) and odd row counts, pushed in fp32 and bf16."""
    from hybrid_rl.workers.fsdp_engine import TrainingEngine

    class Odd(torch.nn.Module):  # fully_shard wants a module with a forward, not a bare container
        def __init__(self):
            super().__init__()
            self.one_row, self.odd, self.wide = torch.nn.Linear(3, 1), torch.nn.Linear(2, 5), torch.nn.Embedding(7, 4)

        def forward(self, x):
            return self.one_row(x)

    torch.manual_seed(0)
    model = Odd()
    engine = TrainingEngine(model, torch.device(DEVICE), torch.float32, trainable=True)
    bad = []
    for dtype in (torch.float32, torch.bfloat16):
        want = {n: full(p).to(dtype) for n, p in engine.model.named_parameters()}
        got = dict(engine.iter_full_params(dtype))
        bad += [f"{n}:{dtype}" for n in want if n not in got or not torch.equal(got[n], want[n])]
    res["uneven_mismatches"] = bad
    res["uneven_local_rows"] = {n: local(p).shape[0] for n, p in engine.model.named_parameters()}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if "--single" in sys.argv:
        run_single(out)
        return
    d = init_distributed(DEVICE)
    assert torch.distributed.is_initialized() and d.world_size > 1, "run me under torchrun with 2+ ranks"
    res: dict = {"world_size": d.world_size}
    which = os.environ.get("MULTIRANK_CHECKS", "full,offload,lora,unsharded,uneven,packed,shared,own_old").split(",")  # also: replay
    if "full" in which:
        run_full_finetune(d, res)
    if "offload" in which:
        run_offload(d, res)
    if "lora" in which:
        run_lora(d, res)
    if "compile" in which:  # not in the default set: compiling takes ~a minute on CPU
        run_compile(d, res)
    if "unsharded" in which:
        run_accumulate_unsharded(d, res)
    if "uneven" in which:
        run_uneven_shards(d, res)
    if "critic_unsharded" in which:  # not in the default set: its own launch (test_multirank.py)
        run_critic_unsharded(d, res)
    if "packed" in which:
        run_packed(d, res)
    if "shared" in which:
        run_shared_prompts(d, res)
    if "own_old" in which:
        run_own_old(d, res)
    if "replay" in which:
        run_replay(d, res)
    torch.save(res, out / f"rank{d.rank}.pt")
    destroy(finished=True)  # the trainer's teardown: a barrier, the cycles collected, then the groups


if __name__ == "__main__":
    main()
    # as ``hybrid_rl.__main__._leave``: a finished rank skips interpreter finalization, where a gloo rank aborted
    # ("terminate called without an active exception": the replay check once, in a fresh clone's CI run)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
