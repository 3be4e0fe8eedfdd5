"""Muon on a Flax NNX model sharded over an Auto mesh, the way Flax's FSDP
guides build it.

The mesh comes from the ``Mesh`` constructor (its axes are Auto), every
parameter carries ``sharding=`` metadata over ('data', 'model'), the model is
created under ``jax.set_mesh`` so its state is sharded from the start, and the
optimizer gets the shardings straight from ``nnx.get_named_sharding``. Muon's
plan then orthogonalizes each whole matrix on one device (the summary's "NS
placement" column) instead of leaving Newton–Schulz to XLA's partitioner.

  python examples/nnx_auto_mesh.py            # 60 steps on 8 virtual CPU
  devices
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402  (XLA_FLAGS must be set first)
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import optax_muon  # noqa: E402
from gpt import batches, stdlib_corpus  # noqa: E402

VOCAB = 256


class ShardedMLPLM(nnx.Module):
  """A byte-level model: embedding, a context mix over the last ``window``
  bytes, two hidden layers and a head, every weight annotated with its mesh
  axes."""

  def __init__(self, d: int, window: int, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.window = window
    self.embed = nnx.Embed(
        VOCAB,
        d,
        embedding_init=nnx.with_partitioning(
            nnx.initializers.normal(0.02), ("model", "data")
        ),
        rngs=rngs,
    )
    self.mix = nnx.Linear(
        window * d,
        2 * d,
        kernel_init=nnx.with_partitioning(init, ("data", "model")),
        bias_init=nnx.with_partitioning(
            nnx.initializers.zeros_init(), ("model",)
        ),
        rngs=rngs,
    )
    self.hidden = nnx.Linear(
        2 * d,
        2 * d,
        kernel_init=nnx.with_partitioning(init, ("model", "data")),
        use_bias=False,
        rngs=rngs,
    )
    self.norm = nnx.LayerNorm(
        2 * d,
        scale_init=nnx.with_partitioning(
            nnx.initializers.ones_init(), ("model",)
        ),
        use_bias=False,
        rngs=rngs,
    )
    self.lm_head = nnx.Linear(
        2 * d,
        VOCAB,
        kernel_init=nnx.with_partitioning(init, ("data", "model")),
        use_bias=False,
        rngs=rngs,
    )

  def __call__(self, context: jax.Array) -> jax.Array:
    x = self.embed(context).reshape(context.shape[0], -1)  # (batch, window·d)
    x = jax.nn.gelu(self.mix(x))
    x = x + jax.nn.gelu(self.hidden(x))
    return self.lm_head(self.norm(x))


def loss_fn(model: ShardedMLPLM, windows: jax.Array) -> jax.Array:
  """Next-byte cross-entropy (nats) of the last byte of each window given the
  others."""
  logits = model(windows[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, windows[:, -1]
  ).mean()


@nnx.jit
def train_step(model, optimizer, windows):
  loss, grads = nnx.value_and_grad(loss_fn)(model, windows)
  optimizer.update(model, grads)
  return loss


def main(argv=None) -> dict:
  """Trains the model; returns the losses, the routing summary and the final
  shardings."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--steps",
      type=int,
      default=60,
      help="training steps (default: %(default)s)",
  )
  parser.add_argument(
      "--d-model",
      type=int,
      default=64,
      help="the model's width; a multiple of 8 (default: %(default)s)",
  )
  parser.add_argument(
      "--batch-size",
      type=int,
      default=64,
      help=(
          "windows per step, split over the 'data' axis (default: %(default)s)"
      ),
  )
  args = parser.parse_args(argv)

  devices = np.array(jax.devices()[:8]).reshape(4, 2)
  mesh = Mesh(
      devices, ("data", "model")
  )  # Auto axes: XLA propagates the shardings
  window = 8
  with jax.set_mesh(mesh):
    model = ShardedMLPLM(args.d_model, window, nnx.Rngs(0))  # created sharded
    param_shardings = nnx.get_named_sharding(nnx.state(model, nnx.Param), mesh)
    tx = optax_muon.muon(
        optax.warmup_cosine_decay_schedule(0.0, 0.02, 10, args.steps),
        adam_learning_rate=3e-3,
        param_shardings=param_shardings,
    )
    summary = optax_muon.summarize(
        nnx.state(model, nnx.Param), tx, print_table=True
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    train, _ = stdlib_corpus(max_bytes=1_000_000)
    data = batches(train, args.batch_size, window, seed=0)
    batch_sharding = NamedSharding(mesh, P("data"))
    losses = []
    for step in range(args.steps):
      windows = jax.device_put(next(data), batch_sharding)
      losses.append(float(train_step(model, optimizer, windows)))
      if step % 20 == 0 or step == args.steps - 1:
        print(f"step {step:4d}  loss {losses[-1]:.3f}")
  final_shardings = jax.tree.map(
      lambda x: x.sharding, nnx.state(model, nnx.Param)
  )
  return {
      "losses": losses,
      "summary": summary,
      "param_shardings": param_shardings,
      "final_shardings": final_shardings,
  }


if __name__ == "__main__":
  main()
