"""With the planner off, the threshold and schedule rules take exactly the actions they took
before the planner existed.

The reference (``planner_off_reference.npz``) was computed once from the code before the
planner landed (commit adee08c), by running this module as a script in that checkout:

    .venv/bin/python -m tests.diffusion.test_planner_off [OUTPUT.npz]

Integers (tokens, steps, masks, forwards) must match exactly. Log-probs matched bitwise on
the machine that pinned them; here they get 1e-6 absolute plus 1e-6 relative (a few float32
ulps at log-probs of -2 to -8) because another CPU may round a float32 reduction differently
(a fresh machine measured 1.2e-6 and 1.4e-6 at -2.4 and -5.6, with every action equal).
"""

import sys
from pathlib import Path

import numpy as np
import pytest

from distill.config import RolloutConfig
from distill.diffusion.denoise import SamplingSettings, rollout
from tests.diffusion.conftest import COMPLETION

REFERENCE = Path(__file__).with_name("planner_off_reference.npz")
CONTRACTS = {"same": ("same_position", "all_masked"), "shifted": ("shifted", "seed_and_mask")}
RULES = {
    "threshold": dict(threshold=0.08, temperature=0.8),
    "threshold_greedy": dict(threshold=0.08, greedy=True),
    "threshold_sampled_prob": dict(threshold=0.08, confidence="sampled_prob"),
    "schedule_confidence": dict(commit_rule="schedule", schedule_steps=4, strategy="confidence"),
    "schedule_random": dict(commit_rule="schedule", schedule_steps=5, strategy="random"),
    "schedule_entropy": dict(commit_rule="schedule", schedule_steps=3, strategy="entropy"),
}
INTEGER_FIELDS = (
    "tokens",
    "positions",
    "segment_ids",
    "prompt_mask",
    "completion_mask",
    "action_steps",
    "forwards",
)


def rollouts(student, tokenizer, prompts) -> dict[str, np.ndarray]:
    """Every (contract, rule) case's trace arrays, flattened as ``case/field``."""
    out = {}
    for contract, (alignment, canvas) in CONTRACTS.items():
        for rule, options in RULES.items():
            config = RolloutConfig(
                max_completion_length=COMPLETION, alignment=alignment, canvas=canvas, **options
            )
            settings = SamplingSettings.from_config(config, tokenizer.special)
            trace = rollout(student, prompts, settings, seed=3, global_step=5)
            for field in (*INTEGER_FIELDS, "action_logps"):
                out[f"{contract}-{rule}/{field}"] = np.asarray(getattr(trace, field))
    return out


@pytest.fixture(scope="module")
def current(student, tokenizer, prompts):
    return rollouts(student, tokenizer, prompts)


@pytest.fixture(scope="module")
def reference():
    with np.load(REFERENCE) as data:
        return {name: data[name] for name in data.files}


@pytest.mark.parametrize("case", [f"{c}-{r}" for c in CONTRACTS for r in RULES])
def test_rules_without_the_planner_take_the_pinned_actions(current, reference, case):
    for field in INTEGER_FIELDS:
        np.testing.assert_array_equal(current[f"{case}/{field}"], reference[f"{case}/{field}"])
    np.testing.assert_allclose(
        current[f"{case}/action_logps"], reference[f"{case}/action_logps"], atol=1e-6, rtol=1e-6
    )


def test_the_reference_covers_multi_token_steps(reference):
    # A reference of one-token steps only would not exercise the rules' selection.
    completion = reference["same-threshold/completion_mask"].sum()
    assert completion > reference["same-threshold/forwards"].sum()


if __name__ == "__main__":
    from flax import nnx

    from distill.config import ModelConfig
    from distill.models.transformer import Transformer
    from distill.tokenizer import CharTokenizer
    from tests.diffusion.conftest import BLOCK

    tok = CharTokenizer()
    config = ModelConfig(
        vocab_size=tok.vocab_size,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        attention_type="block_diffusion",
        block_size=BLOCK,
        init_std=0.15,
    )
    model = Transformer(config, rngs=nnx.Rngs(0))
    texts = ["hi|", "copy:abc|", "sort:dcba21|", "?"]
    arrays = rollouts(model, tok, [tok.encode(text) for text in texts])
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else REFERENCE
    np.savez_compressed(target, **arrays)
    print(f"wrote {len(arrays)} arrays to {target}")
