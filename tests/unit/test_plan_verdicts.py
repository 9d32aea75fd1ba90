"""``benchmarks/plan_verdicts.py``: the configs it judges, the overrides of a long response, the longest-response search."""

from __future__ import annotations

import json
import sys

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import plan_verdicts as pv  # noqa: E402


def test_long_response_overrides_hold_one_sequence():
    ovr = pv.long_response(pv.SEVEN_B, 16384, 4, recompute=False)
    # the recipe's 512-token prompts + 16,384 exceed its 16,384-token budget: raised to 16,896
    assert ovr == ["data.max_response_length=16384", "actor.max_token_len_per_device=16896",
                   "actor.ulysses_sequence_parallel_size=4", "model.enable_gradient_checkpointing=false"]
    assert pv.long_response(pv.SEVEN_B, 2048, 1, True)[1] == "actor.max_token_len_per_device=16384"  # the recipe's
    assert pv.long_response(pv.SEVEN_B, 2048, 1, True, one_sequence=True)[1] == "actor.max_token_len_per_device=2560"


def test_largest_response_is_the_last_length_that_fits():
    found = pv.largest_response(8, "H100", 2, recompute=False)
    longest = found["max_response_length"]
    assert longest % pv.STEP == 0 and 0 < longest < pv.LIMIT and found["first_too_long"] == longest + pv.STEP

    def fits(response: int) -> bool:
        return pv.plan(pv.SEVEN_B, pv.long_response(pv.SEVEN_B, response, 2, False, True), 8, "H100")["fits"]

    assert fits(longest) and not fits(longest + pv.STEP)
    # twice the ranks per row reach about twice as far (the activations of a row are what grows)
    double = pv.largest_response(8, "H100", 4, recompute=False)["max_response_length"]
    assert 1.8 * longest < double < 2.2 * longest


def test_writes_every_config_on_both_boxes(tmp_path):
    doc = pv.main(["--out", str(tmp_path / "v.json")])
    assert json.loads((tmp_path / "v.json").read_text()) == doc
    # the two recipes, then 2 responses × 3 sizes × with and without recomputation; each on 2 boxes
    assert len(doc["configs"]) == (2 + 2 * 3 * 2) * 2 and len(doc["largest_response"]) == 2 * 3 * 2
    seven = {r["box"]: r for r in doc["configs"] if r["name"] == "gsm8k_grpo_7b"}
    assert seven["8xH100"]["fits"] and seven["4xH200"]["fits"]
    assert set(seven["8xH100"]["phases_gib"]) == {"weight push", "generation", "old log-prob", "ref log-prob",
                                                  "actor update"}
