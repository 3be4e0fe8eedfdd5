"""optax's own Muon tests (``optax/contrib/_muon_test.py`` of the installed optax), run with
``optax_muon``'s ``muon``, ``scale_by_muon`` and ``MuonDimensionNumbers`` in place of
optax.contrib's (the helpers private to optax stay optax's). Not collected by pytest (it
takes about a minute); ``.ci/run`` runs it.

  python tests/optax_contrib_suite.py
"""

import pathlib
import subprocess
import sys
import tempfile

import optax.contrib

SHIM = '''\
from optax.contrib._muon import *  # noqa: F403  (the test file's other names stay optax's)
from optax.contrib._muon import _compute_muon_reshape, orthogonalize_via_newton_schulz  # noqa
import optax_muon

muon = optax_muon.muon
scale_by_muon = optax_muon.scale_by_muon
MuonDimensionNumbers = optax_muon.MuonDimensionNumbers
'''


def main() -> int:
  source = pathlib.Path(optax.contrib.__file__).parent / "_muon_test.py"
  if not source.exists():
    print(f"{source} is not in this optax installation", file=sys.stderr)
    return 1
  with tempfile.TemporaryDirectory() as folder:
    folder = pathlib.Path(folder)
    (folder / "optax_muon_in_place_of_contrib.py").write_text(SHIM)
    original = "from optax.contrib import _muon\n"
    text = source.read_text()
    if original not in text:
      print(f"{source} no longer imports the module as expected", file=sys.stderr)
      return 1
    (folder / "test_optax_muon_suite.py").write_text(
        text.replace(original, "import optax_muon_in_place_of_contrib as _muon\n"))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(folder)], cwd=folder).returncode


if __name__ == "__main__":
  sys.exit(main())
