"""LoRA's adapted linears alone: peft's forward and backward against hybrid_rl's fused function, per shape.

    python benchmarks/lora_linear.py                      # a 7B block's seven adapted linears (Qwen2.5-7B), 16k tokens
    python benchmarks/lora_linear.py --tokens 8192 --rank 16
    python benchmarks/lora_linear.py --cpu-smoke          # plumbing only: small shapes on the CPU, a few seconds

For each linear of a Qwen2.5-7B block (q, k, v with their biases, o, gate, up, down), a frozen bf16 base with rank-64
adapters (alpha 16: scaling 0.25; the adapters in the compute dtype, as FSDP2's policy runs them), on
``--tokens`` tokens: the time of one forward and backward (the input's gradient and the adapters'), through peft's
``lora.Linear`` and through ``hybrid_rl/models/lora_fused.py``, the median over ``--iters`` after ``--warmup``
(CUDA events), and each one's peak memory above its inputs. Both are checked to give the same output and gradients
(bf16 tolerance) before timing. Writes ``lora_linear_<device>.json`` (commit, device, settings, every iteration's
time) + ``.png`` into the run directory (``runs/lora_linear/<UTC time>/`` or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import git_commit, gpu_short_name, run_dir  # noqa: E402

QWEN7B = {"q_proj": (3584, 3584, True), "k_proj": (3584, 512, True), "v_proj": (3584, 512, True),
          "o_proj": (3584, 3584, False), "gate_proj": (3584, 18944, False), "up_proj": (3584, 18944, False),
          "down_proj": (18944, 3584, False)}
"""name → (in features, out features, bias) of Qwen2.5-7B's adapted linears (28 blocks of these)."""
SMOKE = {"q_proj": (64, 64, True), "gate_proj": (64, 160, False), "down_proj": (160, 64, False)}


def adapted(n_in: int, n_out: int, bias: bool, rank: int, alpha: int, dtype, device, fused: bool):
    """One frozen linear with peft's LoRA adapters (lora_B non-zero, so the adapters count), fused or not."""
    from peft import LoraConfig, inject_adapter_in_model

    from hybrid_rl.models.lora_fused import fuse_lora_linears

    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.proj = torch.nn.Linear(n_in, n_out, bias=bias)
    holder = inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, target_modules=["proj"]), holder)
    with torch.no_grad():
        for name, p in holder.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    holder = holder.to(device=device, dtype=dtype)  # peft leaves only the adapters trainable
    if fused:
        assert fuse_lora_linears(holder) == 1
    return holder.proj


def one_pass(layer, x, g):
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    y = layer(x)
    y.backward(g)
    return y


def measure(layer, x, g, warmup: int, iters: int, cuda: bool) -> dict:
    for _ in range(warmup):
        one_pass(layer, x, g)
    times = []
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            one_pass(layer, x, g)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            one_pass(layer, x, g)
            times.append((time.perf_counter() - t) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return {"median_ms": statistics.median(times), "ms": times, "peak_above_inputs_mib": peak}


def compare(name, shape, args, dtype, device) -> dict:
    n_in, n_out, bias = shape
    torch.manual_seed(1)
    x = torch.randn(1, args.tokens, n_in, dtype=dtype, device=device, requires_grad=True)
    g = torch.randn(1, args.tokens, n_out, dtype=dtype, device=device)
    layers = {kind: adapted(n_in, n_out, bias, args.rank, args.alpha, dtype, device, kind == "fused")
              for kind in ("peft", "fused")}
    outs = {}
    for kind, layer in layers.items():
        y = one_pass(layer, x, g)
        assert (kind == "fused") == type(y.grad_fn).__name__.startswith("LoraLinearFn"), (kind, y.grad_fn)
        outs[kind] = [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for n, p in
                                                              sorted(layer.named_parameters()) if p.requires_grad]
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    for a, b in zip(outs["fused"], outs["peft"]):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    row = {"linear": name, "in": n_in, "out": n_out, "bias": bias}
    for kind, layer in layers.items():
        row[kind] = measure(layer, x, g, args.warmup, args.iters, device.type == "cuda")
    row["speedup"] = row["peft"]["median_ms"] / row["fused"]["median_ms"]
    return row


def plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.2 for i in xs], [r["peft"]["median_ms"] for r in rows], 0.4, label="peft lora.Linear")
    ax.bar([i + 0.2 for i in xs], [r["fused"]["median_ms"] for r in rows], 0.4, label="fused (lora_fused.py)")
    ax.set_xticks(list(xs), [r["linear"] for r in rows])
    ax.set_ylabel("forward + backward, ms (median)")
    s = doc["settings"]
    ax.set_title(f"LoRA rank {s['rank']}, {s['tokens']} tokens, {s['dtype']} — {doc['device']} @ {doc['commit']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--alpha", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None, help="run directory (default runs/lora_linear/<UTC time>/)")
    ap.add_argument("--cpu-smoke", action="store_true", help="small shapes on the CPU in float32 (plumbing only)")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        shapes, device, dtype = SMOKE, torch.device("cpu"), torch.float32
        args.tokens, args.rank, args.warmup, args.iters = 128, 8, 1, 3
        tag = "cpux1"
    else:
        if not torch.cuda.is_available():
            print("error: lora_linear.py times CUDA kernels and found no GPU; run it on a GPU, or --cpu-smoke",
                  file=sys.stderr)
            return 2
        shapes, device, dtype = QWEN7B, torch.device("cuda"), torch.bfloat16
        tag = gpu_short_name(torch.cuda.get_device_name()) + "x1"
    out = run_dir("lora_linear", args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, shape in shapes.items():
        rows.append(compare(name, shape, args, dtype, device))
        r = rows[-1]
        print(f"{name:10s} {r['in']:>6d}→{r['out']:<6d} peft {r['peft']['median_ms']:8.2f} ms  "
              f"fused {r['fused']['median_ms']:8.2f} ms  ×{r['speedup']:.2f}", flush=True)
    total = {k: sum(r[k]["median_ms"] for r in rows) for k in ("peft", "fused")}
    doc = {"bench": "lora_linear", "commit": git_commit(), "device": tag, "gpu": torch.cuda.get_device_name()
           if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "settings": {"tokens": args.tokens, "rank": args.rank, "alpha": args.alpha, "scaling": args.alpha / args.rank,
                        "dtype": str(dtype).replace("torch.", ""), "warmup": args.warmup, "iters": args.iters,
                        "shapes": "smoke" if args.cpu_smoke else "Qwen2.5-7B block"},
           "rows": rows, "block_ms": total, "block_speedup": total["peft"] / total["fused"]}
    path = out / f"lora_linear_{tag}.json"
    path.write_text(json.dumps(doc, indent=1))
    plot(doc, path.with_suffix(".png"))
    print(f"one block's adapted linears: peft {total['peft']:.2f} ms, fused {total['fused']:.2f} ms "
          f"(×{doc['block_speedup']:.2f}); wrote {path} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
