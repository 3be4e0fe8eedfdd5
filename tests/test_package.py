"""The package's namespace: every module of optax_muon is reachable by its
name."""

import importlib
import pathlib
import types

import optax_muon


def test_no_public_name_shadows_a_module():
  """A function named like its module (``optax_muon.qk_clip``) would hide the
  module's other names (``QKClip``) behind the function."""
  package = pathlib.Path(optax_muon.__file__).parent
  modules = sorted(
      [p.stem for p in package.glob("*.py") if p.stem != "__init__"]
      + [p.name for p in package.iterdir() if (p / "__init__.py").exists()]
  )
  for name in modules:
    importlib.import_module(f"optax_muon.{name}")
  shadowed = [
      n
      for n in modules
      if not isinstance(getattr(optax_muon, n), types.ModuleType)
  ]
  assert not shadowed, shadowed
  assert optax_muon._src.core.qk_clipping.qk_clip is optax_muon.qk_clip
  assert (
      optax_muon._src.muon.newton_schulz.newton_schulz
      is optax_muon.newton_schulz
  )
  assert optax_muon._src.tools.diagnostics.diagnostics is optax_muon.diagnostics
