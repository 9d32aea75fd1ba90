"""Which tokens do vLLM and transformers disagree on for SmolLM2-135M-Instruct? (GPU; the worst ones, with context.)

A GRPO run of builtin:smollm2-135m-instruct logged ``rollout/logprob_diff`` mean 0.056 and max 14.9 (random-init
Qwen2 shapes: 0.017 / 0.11). This samples GSM8K responses with vLLM exactly as the rollout engine does (token-id
prompts, ``processed_logprobs``, ``generation_config="vllm"``, stop on the given eos ids) and recomputes the sampled
tokens' log-probs with the transformers model in bfloat16 (the trainer's compute dtype) and float32, on the padded
layout the trainer sees (``assemble_rollout``). It prints the gaps and the 20 worst tokens with their position, the
text before them, and whether an end-of-turn token came earlier in the response; ``--load push`` starts vLLM from
dummy weights and pushes the actor's tensors under the push plan's names (as training does) instead of loading the
checkpoint, which separates a naming/tying problem from plain numerics. Writes
``logprob_parity_smollm2_<device>_<load>_eos<ids>.json`` into its run directory (``runs/logprob_parity_smollm2/<UTC
time>/`` unless ``--out``; ``benchmarks/publish.py`` copies it to ``benchmarks/results/``).

    python benchmarks/logprob_parity_smollm2.py --prompts 64 --n 8 [--eos-ids 1] [--load push]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_common import ROOT, git_commit, gpu_short_name, run_dir  # noqa: E402

NAME = "builtin:smollm2-135m-instruct"


def hf_logprobs(model, t: dict, chunk: int) -> torch.Tensor:
    """Log-probs [N, R] of ``t['responses']`` under ``model`` on the trainer's padded layout (float32 softmax)."""
    out = []
    R = t["responses"].shape[1]
    for s in range(0, t["input_ids"].shape[0], chunk):
        sl = slice(s, s + chunk)
        with torch.no_grad():
            logits = model(input_ids=t["input_ids"][sl], attention_mask=t["attention_mask"][sl],
                           position_ids=t["position_ids"][sl], use_cache=False).logits[:, -R - 1:-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, t["responses"][sl, :, None])[..., 0])
    return torch.cat(out)


def push_into(llm, model) -> int:
    """Every tensor of the push plan into vLLM's model (dummy weights before): what the sharding manager sends."""
    from hybrid_rl.weights.plan import build_push_plan

    items = [(o.name, o.sources[0].detach().to(torch.bfloat16)) for g in build_push_plan(model, fsdp=False) for o in g]

    def load(worker, items):
        return sorted(worker.model_runner.model.load_weights(weights=items))

    loaded = llm.collective_rpc(load, args=(items,))[0]
    expected = set(llm.collective_rpc(lambda w: [n for n, _ in w.model_runner.model.named_parameters()])[0])
    missing = sorted(expected - set(loaded))
    if missing:
        print(f"vLLM parameters the push never wrote (still dummy): {missing}", flush=True)
    return len(items)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT / "benchmarks" / "data" / "gsm8k_train_1k.jsonl"),
                    help="GSM8K rows (question/answer); default: the 1,024 shipped in benchmarks/data/")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--eos-ids", default=None, help="comma-separated stop ids (default: the tokenizer's eos); "
                                                    "1 reproduces the run where <|im_start|> was the eos")
    ap.add_argument("--load", choices=["checkpoint", "push"], default="checkpoint")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--out", default=None, help="run directory (default runs/logprob_parity_smollm2/<UTC time>/; "
                    "benchmarks/publish.py copies a result to benchmarks/results/)")
    args = ap.parse_args(argv)

    from vllm import LLM, SamplingParams

    from hybrid_rl.data.prompts import PromptDataset, collate_prompts
    from hybrid_rl.models import load_causal_lm, load_tokenizer, resolve_model_path
    from hybrid_rl.rollout.base import assemble_rollout
    from hybrid_rl.rollout.vllm import collect_outputs, unpad_prompts

    dev = torch.device("cuda")
    path = resolve_model_path(NAME)
    tok = load_tokenizer(NAME)
    eos = [int(x) for x in args.eos_ids.split(",")] if args.eos_ids else [tok.eos_token_id]
    rows = [json.loads(line) for line in open(args.data)][: args.prompts]
    ds = PromptDataset(rows, "gsm8k", tok, 512)
    prompts = collate_prompts([ds[i] for i in range(len(ds))], tok.pad_token_id)

    llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", gpu_memory_utilization=0.3,
              max_model_len=512 + args.max_tokens, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
              generation_config="vllm", seed=0, load_format="dummy" if args.load == "push" else "auto",
              enable_sleep_mode=True)
    model32 = load_causal_lm(NAME, torch.float32).to(dev).eval()
    if args.load == "push":
        print(f"pushed {push_into(llm, model32)} tensors", flush=True)
    sp = SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, stop_token_ids=eos,
                        logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in unpad_prompts(prompts.tensors["input_ids"],
                                                                        prompts.tensors["attention_mask"])], sp)
    responses, lps = collect_outputs(outs, args.n, tok.pad_token_id)
    batch = assemble_rollout(prompts.to(dev), responses.to(dev), lps.to(dev), args.n, eos, tok.pad_token_id)
    t = {k: v.to(dev) for k, v in batch.tensors.items()}
    mask = t["response_mask"].bool()
    engine = t["rollout_log_probs"]
    lp32 = hf_logprobs(model32, t, 32)
    model16 = load_causal_lm(NAME, torch.bfloat16).to(dev).eval()
    lp16 = hf_logprobs(model16, t, 32)

    def gap(a, b):
        d = (a - b).abs()[mask]
        return {"mean": float(d.mean()), "max": float(d.max()), "p999": float(d.quantile(0.999)),
                "n_over_1": int((d > 1).sum()), "tokens": int(mask.sum())}

    summary = {"engine_vs_hf_bf16": gap(engine, lp16), "engine_vs_hf_fp32": gap(engine, lp32),
               "hf_bf16_vs_fp32": gap(lp16, lp32)}
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    resp = t["responses"]
    lens = mask.sum(1)
    d = ((engine - lp16).abs() * mask).view(-1)
    worst = []
    for val, ix in zip(*d.topk(min(args.top, int(mask.sum())))):
        r, c = divmod(int(ix), resp.shape[1])
        before = resp[r, :c].tolist()
        worst.append(dict(row=r, pos=c, response_len=int(lens[r]), token=int(resp[r, c]),
                          text=tok.decode([int(resp[r, c])]), context=tok.decode(before[-12:]),
                          engine=float(engine[r, c]), hf_bf16=float(lp16[r, c]), hf_fp32=float(lp32[r, c]),
                          gap=float(val), im_end_before=im_end in before, im_start_before=im_start in before,
                          prompt_len=int(t["attention_mask"][r, : t["prompts"].shape[1]].sum())))
    stopped = sum(1 for r in range(len(resp)) if lens[r] and int(resp[r, int(lens[r]) - 1]) in eos)
    device = f"{gpu_short_name(torch.cuda.get_device_name(0))}x1"
    doc = dict(benchmark="logprob_parity_smollm2", device=device, commit=git_commit(), load=args.load, eos_ids=eos,
               prompts=len(ds), n=args.n, temperature=args.temperature, max_tokens=args.max_tokens,
               stopped_on_eos=stopped, sequences=len(resp), mean_response_len=float(lens.float().mean()),
               gaps=summary, worst=worst,
               settings={k: v if isinstance(v, (bool, int, float, str, type(None))) else str(v)
                         for k, v in vars(args).items()})
    out = run_dir("logprob_parity_smollm2", args.out)
    out /= f"logprob_parity_smollm2_{device}_{args.load}_eos{'-'.join(map(str, eos))}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: doc[k] for k in ("device", "commit", "load", "eos_ids", "stopped_on_eos", "sequences",
                                          "mean_response_len", "gaps")}))
    for w in worst[:10]:
        print(json.dumps(w))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
