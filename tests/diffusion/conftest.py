"""A tiny student shared by the rollout / replay tests (module-scoped jit reuse)."""

import pytest
from flax import nnx

from distill.config import ModelConfig
from distill.models.transformer import Transformer
from distill.tokenizer import CharTokenizer

BLOCK = 4
COMPLETION = 10  # not a multiple of BLOCK: partial blocks at both ends of the completion


@pytest.fixture(scope="session")
def tokenizer():
    return CharTokenizer()


@pytest.fixture(scope="session")
def student(tokenizer):
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        attention_type="block_diffusion",
        block_size=BLOCK,
        init_std=0.15,
    )
    return Transformer(config, rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def prompts(tokenizer):
    # Mixed lengths: 3 (inside block 0), 9 (inside block 2), 12 (block-aligned), 1.
    texts = ["hi|", "copy:abc|", "sort:dcba21|", "?"]
    return [tokenizer.encode(text) for text in texts]
