"""Sphinx configuration: API reference from the docstrings, topic pages in
Markdown, the quickstart notebook executed at build time (about a minute on a
CPU). Builds offline (no intersphinx)."""

import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import optax_muon  # noqa: E402
from sphinx.pycode import ModuleAnalyzer  # noqa: E402

project = "optax_muon"
author = "optax_muon developers"
release = optax_muon.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "myst_nb",
]
source_suffix = {
    ".rst": "restructuredtext",
    ".md": "myst-nb",
    ".ipynb": "myst-nb",
}
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3
# The notebook is stored without outputs; every build runs it, so the page shows
# what this checkout prints. A failing cell fails the build.
nb_execution_mode = "force"
nb_execution_raise_on_error = True
nb_execution_timeout = 600  # seconds per cell; training takes about a minute
nb_merge_streams = (
    True  # lines printed in a loop show as one block, not one per print
)

autodoc_typehints = "none"  # the docstrings' Args say what each argument takes
autodoc_member_order = "bysource"
autodoc_default_options = {"members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "sphinx_book_theme"
html_title = "optax_muon"
html_theme_options = {"show_toc_level": 2}
suppress_warnings = ["myst.header"]

# The notebook lives with the examples; the site renders a copy, run in its own
# folder with the example model it imports beside it.
_NOTEBOOKS = pathlib.Path(__file__).parent / "notebooks"
_NOTEBOOKS.mkdir(exist_ok=True)
for _name in ("quickstart.ipynb", "gpt.py"):
  shutil.copyfile(ROOT / "examples" / _name, _NOTEBOOKS / _name)


def _defining_comment(app, what, name, obj, options, lines):
  """A constant that ``optax_muon`` re-exports gets the ``#:`` comment of the
  module that defines it; autodoc, reading ``optax_muon/__init__.py``, would
  show its type's docstring (tuple's, dict's)."""
  del app, obj, options
  if what != "data" or not name.startswith("optax_muon."):
    return
  attribute = name.rsplit(".", 1)[1]
  for module in sorted(m for m in sys.modules if m.startswith("optax_muon.")):
    comment = (
        ModuleAnalyzer.for_module(module).find_attr_docs().get(("", attribute))
    )
    if comment:
      lines[:] = list(comment)
      return


def setup(app):
  app.connect("autodoc-process-docstring", _defining_comment)
