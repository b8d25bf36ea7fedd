"""Run in a fresh process (the device count is fixed at JAX start-up): on 8 forced host CPU
devices, a (data=2, model=4) sharded forward equals the unsharded one. Exits non-zero on
any mismatch. Used by test_sharding.py; not collected by pytest itself."""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from distill.config import ModelConfig  # noqa: E402
from distill.models import sharding  # noqa: E402
from distill.models.transformer import Transformer  # noqa: E402


def main() -> None:
    jax.config.update("jax_default_matmul_precision", "float32")
    assert jax.device_count() == 8, jax.devices()
    for attention_type in ("causal", "block_diffusion"):
        config = ModelConfig(
            vocab_size=40,
            d_model=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=4,
            d_ff=64,
            attention_type=attention_type,
            block_size=4,
            init_std=0.2,
        )
        model = Transformer(config, rngs=nnx.Rngs(0))
        tokens = jax.random.randint(jax.random.key(1), (4, 12), 0, config.vocab_size)
        positions = jnp.broadcast_to(jnp.arange(12), tokens.shape)
        segments = jnp.ones_like(tokens)
        expected = np.asarray(model(tokens, positions, segments))

        mesh = sharding.make_mesh(data=2, model=4)
        sharding.shard_module(model, mesh)
        kernel = model.layers[0].attention.q_proj.kernel[...]
        assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model"), kernel.sharding
        tokens, positions, segments = (
            jax.device_put(x, sharding.batch_sharding(mesh, x.ndim))
            for x in (tokens, positions, segments)
        )
        with sharding.use_mesh(mesh):
            logits = nnx.jit(lambda m, t, p, s: m(t, p, s))(model, tokens, positions, segments)
        assert logits.sharding.spec[0] == "data", logits.sharding
        np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-5, rtol=1e-5)
        print(f"{attention_type}: sharded logits equal unsharded (8 devices, data=2, model=4)")


if __name__ == "__main__":
    main()
