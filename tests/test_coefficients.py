"""Coefficient tables: the Polar Express generator and the exact-arithmetic
bounds."""

import numpy as np
import pytest

import optax_muon as om

PUBLISHED_8 = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]


def test_generator_reproduces_published_table():
  raw = np.array(om.polar_express_coefficients(8, 1e-3, safety=0.0))
  np.testing.assert_allclose(raw, PUBLISHED_8, rtol=0, atol=1e-6)


def test_generator_applies_safety_to_all_rows_but_last():
  safe = om.polar_express_coefficients(8, 1e-3)
  for (a, b, c), (pa, pb, pc) in zip(safe[:-1], PUBLISHED_8[:-1]):
    np.testing.assert_allclose(
        (a, b, c), (pa / 1.01, pb / 1.01**3, pc / 1.01**5), rtol=1e-9
    )
  assert safe[-1] == PUBLISHED_8[-1]


def test_generator_is_greedy_and_collapses_to_the_limit():
  long = om.polar_express_coefficients(12, 1e-3, safety=0.0)
  assert long[:7] == om.polar_express_coefficients(7, 1e-3, safety=0.0)
  assert long[-1] == (1.875, -1.25, 0.375)


@pytest.mark.parametrize("lower_bound", [1e-2, 1e-3, 1e-4])
def test_generated_tables_improve_with_steps(lower_bound):
  errors = [
      max(
          abs(v - 1)
          for v in om.singular_value_range(
              ("polar_express", s, lower_bound), lower_bound
          )
      )
      for s in range(3, 9)
  ]
  assert all(b <= a + 1e-12 for a, b in zip(errors, errors[1:])), errors


def test_six_step_table_within_one_percent_exactly():
  lo, hi = om.singular_value_range("polar_express", 1e-3, ns_steps=6)
  assert 0.99 <= lo and hi <= 1.01


def test_documented_bounds():
  lo, hi = om.singular_value_range("jordan", 1e-3)
  assert 0.45 < lo < 0.5 and 1.19 < hi < 1.21  # Notes: Jordan ×5 [0.47, 1.20].
  lo, hi = om.singular_value_range("deepseek_v4", 1e-3)
  assert 0.9999 <= lo and hi <= 1.0006  # Notes: [1.0000, 1.0005].


def test_bad_generator_arguments():
  with pytest.raises(ValueError, match="lower_bound"):
    om.polar_express_coefficients(5, 1.5)
  with pytest.raises(ValueError, match="steps"):
    om.polar_express_coefficients(0)
