"""Newton–Schulz accuracy against the SVD polar factor, degenerate inputs and
bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

import optax_muon as om
from optax_muon._src.muon.coefficients import resolve_coefficients
from optax_muon._src.muon.costs import ns_flops
from helpers import (
    matrix_with_spectrum,
    numpy_newton_schulz,
    rel_err,
    singular_values,
)


def _two_decade_matrices(m=48, n=96, batch=3, seed=0):
  """Batch of matrices with singular values log-spaced over [0.01, 1]."""
  rng = np.random.default_rng(seed)
  sv = np.geomspace(1e-2, 1.0, min(m, n))
  return np.stack(
      [matrix_with_spectrum(rng, m, n, sv) for _ in range(batch)]
  ).astype(np.float32)


@pytest.mark.parametrize("shape", [(48, 96), (96, 48)])
@pytest.mark.parametrize(
    "preset,steps,lo,hi",
    [
        ("polar_express", 6, 0.99, 1.01),
        ("jordan", 5, 0.6, 1.25),
        ("deepseek_v4", None, 0.995, 1.005),
    ],
)
def test_preset_singular_values_on_ill_conditioned(
    shape, preset, steps, lo, hi
):
  x = _two_decade_matrices(*shape)
  out = jax.jit(lambda x: om.newton_schulz(x, preset, ns_steps=steps))(x)
  sv = singular_values(out)
  assert sv.min() >= lo and sv.max() <= hi, (sv.min(), sv.max())


def test_polar_express_8_steps_matches_msign():
  x = _two_decade_matrices(32, 80, batch=2, seed=1)
  out = om.newton_schulz(x, "polar_express", ns_steps=8)
  assert rel_err(out, om.msign(x)) < 2e-3


def test_jordan_is_not_orthogonal_but_polar_express_is():
  """A wrong iteration (e.g. a dropped c·A² term) fails these bounds."""
  x = _two_decade_matrices(64, 64, batch=1, seed=2)
  sv_jordan = singular_values(om.newton_schulz(x, "jordan"))
  assert sv_jordan.max() - sv_jordan.min() > 0.2  # Jordan's documented spread.
  sv_pe = singular_values(om.newton_schulz(x, "polar_express", ns_steps=8))
  assert np.abs(sv_pe - 1).max() < 1e-3


def test_output_keeps_singular_vectors():
  x = _two_decade_matrices(32, 64, batch=1, seed=3)[0]
  out = np.asarray(om.newton_schulz(x, "polar_express", ns_steps=8), np.float64)
  # O = U V^T  ⇒  O^T X = V Σ V^T is symmetric positive semi-definite.
  sym = out.T @ x
  assert np.allclose(sym, sym.T, atol=1e-4)
  assert np.linalg.eigvalsh((sym + sym.T) / 2).min() > -1e-4


def test_batch_axes_are_independent():
  x = _two_decade_matrices(16, 24, batch=4, seed=4)
  x[2] *= 1e3  # Per-matrix normalization: scale must not leak across the batch.
  batched = om.newton_schulz(
      x.reshape(2, 2, 16, 24), "polar_express", ns_steps=8
  )
  singles = np.stack(
      [om.newton_schulz(xi, "polar_express", ns_steps=8) for xi in x]
  )
  assert rel_err(np.asarray(batched).reshape(4, 16, 24), singles) < 1e-5


def test_more_steps_repeat_last_row_fewer_take_first_rows():
  x = _two_decade_matrices(12, 20, batch=1, seed=5)[0]
  table = [(3.0, -3.2, 1.2), (2.5, -2.0, 0.6), (2.0, -1.5, 0.5)]
  more = om.newton_schulz(x, table, ns_steps=5)
  fewer = om.newton_schulz(x, table, ns_steps=2)
  assert rel_err(more, numpy_newton_schulz(x, table + [table[-1]] * 2)) < 1e-4
  assert rel_err(fewer, numpy_newton_schulz(x, table[:2])) < 1e-4
  # The DeepSeek hybrid keeps its 10 steps; it is not truncated to a default of
  # 5.
  assert resolve_coefficients("deepseek_v4").steps == 10
  assert resolve_coefficients("deepseek_v4").rows[-1] == (2.0, -1.5, 0.5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_zero_input_is_zero_not_nan(dtype):
  out = om.newton_schulz(jnp.zeros((8, 16), dtype))
  assert out.dtype == dtype
  assert np.all(np.asarray(out, np.float32) == 0)


@pytest.mark.parametrize(
    "shape", [(1, 64), (64, 1), (1, 4096), (4096, 1), (1, 1)]
)
def test_vector_shaped_matrices(shape):
  """A rank-1 matrix's polar factor is x / ‖x‖."""
  x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
  out = om.newton_schulz(x, "polar_express", ns_steps=8)
  assert rel_err(out, x / np.linalg.norm(x)) < 1e-3


@pytest.mark.parametrize("scale", [1e-30, 1e-15, 1e15])
def test_extreme_scales_are_scale_invariant(scale):
  x = _two_decade_matrices(16, 32, batch=1, seed=6)[0]
  ref = om.newton_schulz(x, "polar_express", ns_steps=8)
  out = om.newton_schulz(x * np.float32(scale), "polar_express", ns_steps=8)
  assert np.all(np.isfinite(out))
  assert rel_err(out, ref) < 1e-4


def test_fp16_large_values_do_not_overflow():
  """Near float16's largest value (65504) the normalization still happens in
  float32: the result is the float64 reference's, to float16's precision."""
  rng = np.random.default_rng(9)
  x = jnp.asarray(6e4 * rng.uniform(-1, 1, (16, 24)), jnp.float16)
  out = np.asarray(om.newton_schulz(x), np.float32)
  table = resolve_coefficients("jordan")
  assert (
      rel_err(out, numpy_newton_schulz(np.asarray(x, np.float64), table)) < 2e-2
  )


@pytest.mark.parametrize("preset", ["polar_express", "deepseek_v4"])
def test_bf16_compute_stays_close_to_msign(preset):
  """bf16 matmuls with float32 normalization, for presets whose exact bound is <
  1e-2."""
  steps = 8 if preset == "polar_express" else None
  assert (
      max(abs(v - 1) for v in om.singular_value_range(preset, ns_steps=steps))
      < 1e-2
  )
  x = _two_decade_matrices(64, 128, batch=2, seed=7)
  out = om.newton_schulz(x, preset, ns_steps=steps, compute_dtype=jnp.bfloat16)
  assert out.dtype == jnp.float32
  sv = singular_values(out)
  assert np.all(np.isfinite(sv)) and np.abs(sv - 1).max() < 2e-2


def test_nan_input_propagates():
  """Documented: NaN/Inf gradients give NaN updates (use
  optax.apply_if_finite)."""
  x = np.ones((4, 4), np.float32)
  x[0, 0] = np.nan
  assert np.all(np.isnan(om.newton_schulz(x)))


def test_msign_rank_deficient():
  rng = np.random.default_rng(8)
  x = matrix_with_spectrum(rng, 10, 20, np.array([1.0, 0.5, 0.2] + [0.0] * 7))
  ref = om.msign(x.astype(np.float32))
  assert np.allclose(singular_values(ref)[:3], 1, atol=1e-5)
  assert np.allclose(singular_values(ref)[3:], 0, atol=1e-5)
  out = om.newton_schulz(x.astype(np.float32), "polar_express", ns_steps=8)
  assert rel_err(out, ref) < 5e-3


@pytest.mark.parametrize(
    "coeffs,match",
    [
        ("newton", "Unknown Newton–Schulz preset 'newton'"),
        ([], r"shape \(0,\)"),
        ([(1.0, 2.0)], r"shape \(1, 2\)"),
        ([[1.0, 2.0, 3.0], [1.0, 2.0]], "must be a preset name"),
        ([(1.0, float("nan"), 0.0)], "finite"),
        (("jordan", 5, 1e-3), "Only \\('polar_express'"),
    ],
)
def test_bad_coefficients(coeffs, match):
  with pytest.raises(ValueError, match=match):
    om.newton_schulz(jnp.ones((4, 4)), coeffs)


@pytest.mark.parametrize("steps", [0, -1, 2.5, True])
def test_bad_steps(steps):
  with pytest.raises(ValueError, match="steps must be a positive integer"):
    om.newton_schulz(jnp.ones((4, 4)), ns_steps=steps)


def test_bad_arrays():
  with pytest.raises(
      ValueError, match=r"shape \(\.\.\., m, n\); got shape \(4,\)"
  ):
    om.newton_schulz(jnp.ones(4))
  with pytest.raises(ValueError, match="floating-point"):
    om.newton_schulz(jnp.ones((4, 4), jnp.int32))


@pytest.mark.slow
@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 40),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]),
    log_scale=st.floats(-20, 20),
    seed=st.integers(0, 2**16),
)
def test_property_polar_express_is_orthogonal(m, n, dtype, log_scale, seed):
  """Any shape, dtype and scale: finite, same shape/dtype, and singular values
  near 1 for well-conditioned inputs."""
  # The input itself must be representable (fp16 spans about 6e-5 .. 6e4 at full
  # precision).
  assume(dtype != jnp.float16 or -3 <= log_scale <= 3)
  rng = np.random.default_rng(seed)
  sv = np.geomspace(0.1, 1.0, min(m, n)) * 10.0**log_scale
  x = matrix_with_spectrum(rng, m, n, sv).astype(np.float32)
  out = om.newton_schulz(jnp.asarray(x, dtype), "polar_express", ns_steps=8)
  assert out.shape == (m, n) and out.dtype == dtype
  got = singular_values(np.asarray(out, np.float32))
  assert np.all(np.isfinite(got))
  tol = 2e-3 if dtype == jnp.float32 else 6e-2
  assert np.abs(got - 1).max() < tol, got


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset,steps", [("jordan", 5), ("polar_express", 6), ("polar_express", 8)]
)
@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (24, 24)])
def test_gram_iteration_matches_standard(preset, steps, shape):
  """Gram-space NS (with restarts) is the same iteration: within 2e-5 in
  float32."""
  x = _two_decade_matrices(*shape, batch=2, seed=9)
  standard = om.newton_schulz(x, preset, ns_steps=steps, method="standard")
  gram = om.newton_schulz(x, preset, ns_steps=steps, method="gram")
  assert rel_err(gram, standard) < 2e-5


def test_auto_method_picks_gram_only_where_it_saves_flops():
  from optax_muon._src.muon.costs import uses_gram

  assert uses_gram("auto", 256, 1024, 5)
  assert not uses_gram("auto", 256, 256, 5)
  assert not uses_gram("auto", 256, 1024, 5, compute_dtype=jnp.bfloat16)
  assert ns_flops(256, 1024, 5, gram=True) < 0.7 * ns_flops(256, 1024, 5)
  with pytest.raises(ValueError, match="Unknown Newton–Schulz method 'fast'"):
    om.newton_schulz(jnp.ones((4, 8)), method="fast")
  with pytest.raises(
      ValueError, match="gram_restart must be a positive integer"
  ):
    om.newton_schulz(jnp.ones((4, 8)), gram_restart=0)


@pytest.mark.slow
@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    m=st.integers(2, 48),
    n=st.integers(2, 48),
    seed=st.integers(0, 2**16),
    log_floor=st.floats(-2.0, 0.0),
    preset=st.sampled_from(
        [
            ("polar_express", 8, 1e-2),
            ("deepseek_v4", None, 1e-2),
            ("jordan", 5, 0.55),
        ]
    ),
)
def test_property_accuracy_over_spectra(m, n, seed, log_floor, preset):
  """Random spectra in [10^log_floor, 1] (normalized σ ≥ 1e-3): each preset
  stays within its exact-arithmetic bound (Jordan ×5: 0.53) plus rounding."""
  name, steps, tol = preset
  rng = np.random.default_rng(seed)
  sv = np.sort(10.0 ** rng.uniform(log_floor, 0.0, min(m, n)))[::-1]
  x = matrix_with_spectrum(rng, m, n, sv).astype(np.float32)
  got = singular_values(om.newton_schulz(x, name, ns_steps=steps))
  assert np.abs(got - 1).max() < tol, (got.min(), got.max())


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_products_carry_the_precision_asked_for(method):
  """float32 NS: every product at HIGHEST precision (a TPU's DEFAULT is one
  bfloat16 pass, a GPU's allows TF32); bfloat16 NS: bf16 operands accumulated in
  float32."""
  import re  # noqa: PLC0415

  x = jnp.ones((16, 64))
  for compute, want in (
      (jnp.float32, "precision = [HIGHEST, HIGHEST]"),
      (jnp.bfloat16, "bf16>) -> tensor<"),
  ):
    text = (
        jax.jit(
            lambda x: om.newton_schulz(x, compute_dtype=compute, method=method)  # noqa: B023 (called in this iteration)
        )
        .lower(x)
        .as_text()
    )
    dots = [l for l in text.splitlines() if "stablehlo.dot_general" in l]
    assert dots and all(want in l for l in dots), (compute, dots[:2])
    if compute == jnp.bfloat16:
      assert all(re.search(r"-> tensor<[\dx]+xf32>", l) for l in dots), dots[:2]
