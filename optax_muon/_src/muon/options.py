"""Muon's own options: how Newton–Schulz runs (``NSOptions``), NorMuon
(``NorMuon``), and ``MuonOptions``, the static options of one Muon
transformation (the shared ``TreeOptions`` and Muon's own)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from optax_muon._src.core.options import (
    check_choice,
    check_number,
    dtype_or_none,
)
from optax_muon._src.core import profiles
from optax_muon._src.core.spec import TreeOptions
from optax_muon._src.muon.costs import GRAM_RESTART, METHODS, matrix_flops

MOMENTUM_KINDS = ("ema", "ema_uncorrected", "sum")


@dataclasses.dataclass(frozen=True)
class NSOptions:
  """How Newton–Schulz runs (the coefficients are ``ns_coeffs``/``ns_steps``).

  Attributes:
    compute_dtype: dtype of the NS matrix products: ``"auto"`` (bfloat16
      operands with float32 accumulation on TPUs and GPUs, the input's dtype —
      the momentum's, float32 for 16-bit params — elsewhere), a dtype
      (``jnp.float32``: full-precision products on every backend), or ``None``
      (the input's dtype everywhere).
    method: ``"standard"``, ``"gram"`` (the iteration carried out on the short
      side's Gram matrix, restarted every ``gram_restart`` steps) or ``"auto"``
      (Gram where it needs fewer FLOPs and the products run in float32 or wider;
      see ``newton_schulz``).
    gram_restart: steps between Gram restarts, a positive integer.
    stack_same_shape: run same-shape matrices (short side first) as one batched
      NS call instead of one call per leaf.

  Examples:
    >>> import jax.numpy as jnp, optax_muon
    >>> optax_muon.NSOptions(compute_dtype=jnp.bfloat16).method
    'auto'
    >>> optax_muon.NSOptions(method="fast")
    Traceback (most recent call last):
    ...
    ValueError: NSOptions.method must be one of ('standard', 'gram', 'auto'),
    got 'fast'.
  """

  compute_dtype: Any = "auto"
  method: str = "auto"
  gram_restart: int = GRAM_RESTART
  stack_same_shape: bool = True

  def __post_init__(self):
    if not (
        isinstance(self.compute_dtype, str) and self.compute_dtype == "auto"
    ):
      object.__setattr__(
          self, "compute_dtype", dtype_or_none(self.compute_dtype)
      )
    check_choice("NSOptions", "method", self.method, METHODS)
    if (
        isinstance(self.gram_restart, bool)
        or not isinstance(self.gram_restart, int)
        or self.gram_restart < 1
    ):
      raise ValueError(
          "NSOptions.gram_restart must be a positive integer, got "
          f"{self.gram_restart!r}."
      )

  def resolved(self, platform: str) -> NSOptions:
    """These options with ``compute_dtype`` settled for devices of ``platform``
    (``"auto"``: bfloat16 on ``"tpu"`` and ``"gpu"``, else None)."""
    if not isinstance(self.compute_dtype, str):
      return self
    return dataclasses.replace(
        self,
        compute_dtype=jnp.bfloat16
        if platform in profiles.ACCELERATORS
        else None,
    )

  def flops(self, m: int, n: int, dtype: Any, steps: int, team: int = 1) -> int:
    """NS FLOPs of ``steps`` steps on one m × n matrix of ``dtype`` under these
    options, on each member of a team of ``team`` devices, on the default
    backend's devices (``costs.matrix_flops``)."""
    return matrix_flops(self, m, n, dtype, steps, team)


@dataclasses.dataclass(frozen=True)
class NorMuon:
  """NorMuon: after Newton–Schulz, each output neuron's update is divided by the
  root of an EMA of its mean square, then the matrix gets its Frobenius norm
  back (see ``normuon``).

  Attributes:
    beta: β₂ of the second-moment EMA, in [0, 1).

  References:
    Li et al., `NorMuon: Making Muon more efficient and scalable
    <https://arxiv.org/abs/2510.05491>`_, 2025.
  """

  beta: float = 0.95

  def __post_init__(self):
    check_number("NorMuon.beta", self.beta, 0.0, 1.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MuonOptions(TreeOptions):
  """The static options of one Muon transformation (hashable, no arrays).

  Attributes:
    ns_steps: Newton–Schulz steps (the resolved count).
    ns: how NS runs.
    normalization: NorMuon, or None.

  and every attribute of ``TreeOptions``.
  """

  ns_steps: int
  ns: NSOptions = NSOptions()
  normalization: NorMuon | None = None

  __hash__ = TreeOptions.__hash__
