"""The package's shape: a public face of curated names, each on the API page, over
an implementation in layers (core below two sibling optimizers, tools above them)
that import only downwards."""

import ast
import pathlib
import re

import optax_muon

PACKAGE = pathlib.Path(optax_muon.__file__).parent
ROOT = PACKAGE.parent

# Which implementation layers each layer may import (besides itself).
ALLOWED = {
    "core": set(),
    "muon": {"core"},
    "dion": {"core"},
    "tools": {"core"},
}


def _imported_modules(path: pathlib.Path) -> set[str]:
  modules = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      modules.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      modules.add(node.module)
      modules.update(f"{node.module}.{a.name}" for a in node.names)
  return modules


def test_layers_import_only_downwards():
  """core imports no optimizer; Muon and Dion never import each other; the tools
  read both through core's reports, never an optimizer's internals."""
  broken = []
  for layer, allowed in ALLOWED.items():
    for path in sorted((PACKAGE / "_src" / layer).rglob("*.py")):
      for module in _imported_modules(path):
        m = re.match(r"optax_muon\._src\.(\w+)", module)
        if m and m.group(1) != layer and m.group(1) not in allowed:
          broken.append(f"{path.relative_to(ROOT)} imports {module}")
        if (
            module == "optax_muon"
            or module.startswith("optax_muon.")
            and (not module.startswith("optax_muon._src"))
        ):
          broken.append(f"{path.relative_to(ROOT)} imports the face: {module}")
  assert not broken, "\n".join(broken)


def test_the_face_is_curated_and_documented():
  """At most 33 public names (31, and Dion's two replica tools), all of the
  face's attributes, each on the API page."""
  names = optax_muon.__all__
  assert len(names) == len(set(names)) and len(names) <= 33, names
  assert sorted(n for n in dir(optax_muon) if not n.startswith("_")) == sorted(
      names
  ), "every public attribute of the face is in __all__"
  api = (ROOT / "docs" / "api.rst").read_text()
  documented = set(
      re.findall(r"^\.\. auto(?:function|class|data):: (\w+)\s*$", api, re.M)
  )
  assert set(names) <= documented, sorted(set(names) - documented)


def test_no_test_module_imports_another():
  """Shared test code lives in helper modules, not in another test file."""
  tests = pathlib.Path(__file__).parent
  test_modules = {p.stem for p in tests.glob("test_*.py")}
  offenders = [
      f"{p.name} imports {m}"
      for p in sorted(tests.glob("*.py"))
      for m in _imported_modules(p)
      if m.split(".")[0] in test_modules
  ]
  assert not offenders, offenders
