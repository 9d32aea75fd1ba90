"""A run with ``model.chat_template`` of its own: the prompts it trains and validates on are that template's, and
the exported model's tokenizer carries it (what a user serving the model needs to prompt it as trained)."""

from __future__ import annotations

import json
import sys

from helpers import ROOT, run_checked

TEMPLATE = "Q: {{ messages[-1]['content'] }}{% if add_generation_prompt %} A:{% endif %}"


def test_the_run_prompts_with_its_template_and_the_export_keeps_it(tmp_path):
    out = tmp_path / "run"
    run_checked([sys.executable, "-m", "hybrid_rl", "train", str(ROOT / "recipes" / "cpu_successor.yaml"),
                 f"trainer.output_dir={out}", "trainer.logger=[jsonl]", "trainer.total_steps=1", "trainer.test_freq=1",
                 "data.max_val_samples=5", "trainer.validation_data_dir=val", f"model.chat_template={TEMPLATE}"],
                timeout=300)
    samples = [json.loads(line) for line in (out / "val" / "step_00000001_rank0.jsonl").read_text().splitlines()]
    assert len(samples) == 5
    for s in samples:  # the successor task's user turn is the digit alone
        assert s["prompt"] == f"Q: {(int(s['ground_truth']) - 1) % 10} A:", s["prompt"]
    run_checked([sys.executable, "-m", "hybrid_rl", "export", str(out), str(tmp_path / "hf")], timeout=300)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.chat_template == TEMPLATE
    assert tok.apply_chat_template([{"role": "user", "content": "4"}], add_generation_prompt=True,
                                   tokenize=False) == "Q: 4 A:"
