"""optax's own tests of ``optax.contrib.muon``, run with ``optax_muon`` in its
place.

Two files of the installed optax:

- ``optax/contrib/_muon_test.py``: optax's Muon tests, with ``optax_muon``'s
  ``muon``, ``scale_by_muon`` and ``MuonDimensionNumbers`` in place of
  optax.contrib's (the helpers private to optax stay optax's);
- ``optax/contrib/_common_test.py``: the battery every contributed optimizer
  passes (extra arguments, convergence on small targets, ``inject_hyperparams``,
  dtype preservation, ``MultiSteps``, state stability under ``lax.cond``,
  schedules), its Muon cases only, with ``optax.contrib.muon`` pointing at
  ``optax_muon.muon``.

Not collected by pytest (it takes a few minutes); ``.ci/run`` runs it::

  python tests/optax_contrib_suite.py
"""

import pathlib
import subprocess
import sys
import tempfile

import optax.contrib

MUON_SHIM = """\
# The test file's other names stay optax's.
from optax.contrib._muon import *  # noqa: F403
from optax.contrib._muon import _compute_muon_reshape  # noqa: F401
from optax.contrib._muon import orthogonalize_via_newton_schulz  # noqa: F401
import optax_muon

muon = optax_muon.muon
scale_by_muon = optax_muon.scale_by_muon
MuonDimensionNumbers = optax_muon.MuonDimensionNumbers
"""

# The battery looks optimizers up by name in optax.contrib.
COMMON_SHIM = """\
import optax.contrib
import optax_muon

optax.contrib.muon = optax_muon.muon
"""

# Keeps the battery's Muon cases only (its parameter lists are read when the
# class is made).
ONLY_MUON = """\
_ALL_OPTIMIZERS_UNDER_TEST = tuple(o for o in _ALL_OPTIMIZERS_UNDER_TEST
                                   if o["opt_name"] == "muon")
_MAIN_OPTIMIZERS_UNDER_TEST = tuple(o for o in _MAIN_OPTIMIZERS_UNDER_TEST
                                    if o["opt_name"] == "muon")


class ContribTest("""


def _copy(
    source: pathlib.Path, replacements: dict[str, str], target: pathlib.Path
) -> bool:
  text = source.read_text()
  for original, replacement in replacements.items():
    if original not in text:
      print(f"{source} no longer contains {original!r}", file=sys.stderr)
      return False
    text = text.replace(original, replacement, 1)
  target.write_text(text)
  return True


def main() -> int:
  contrib = pathlib.Path(optax.contrib.__file__).parent
  for name in ("_muon_test.py", "_common_test.py"):
    if not (contrib / name).exists():
      print(
          f"{contrib / name} is not in this optax installation", file=sys.stderr
      )
      return 1
  with tempfile.TemporaryDirectory() as folder:
    folder = pathlib.Path(folder)
    (folder / "optax_muon_in_place_of_contrib.py").write_text(MUON_SHIM)
    (folder / "optax_muon_as_contrib_muon.py").write_text(COMMON_SHIM)
    ok = _copy(
        contrib / "_muon_test.py",
        {
            "from optax.contrib import _muon\n": (
                "import optax_muon_in_place_of_contrib as _muon\n"
            )
        },
        folder / "test_muon_suite.py",
    )
    ok = ok and _copy(
        contrib / "_common_test.py",
        {
            "from optax import contrib\n": (
                "from optax import contrib\nimport optax_muon_as_contrib_muon "
                " # noqa: F401\n"
            ),
            "class ContribTest(": ONLY_MUON,
        },
        folder / "test_common_battery.py",
    )
    if not ok:
      return 1
    run = lambda *args: subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=folder,
    ).returncode
    codes = [run("test_muon_suite.py"), run("test_common_battery.py")]
    return max(codes)


if __name__ == "__main__":
  sys.exit(main())
