"""The README and the documentation pages: every Python block runs as written,
every link points at a file of the repository, every public name has an API
entry."""

import pathlib
import re

import pytest

import optax_muon

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (page, block)
    for page in PAGES
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "page,block",
    BLOCKS,
    ids=[f"{p.relative_to(ROOT)}:{i}" for i, (p, _) in enumerate(BLOCKS)],
)
def test_python_block_runs(page, block, capsys):
  exec(compile(block, str(page), "exec"), {})  # noqa: S102
  capsys.readouterr()


def test_every_page_has_runnable_examples_where_it_shows_code():
  assert {p.name for p, _ in BLOCKS} >= {
      "README.md",
      "getting_started.md",
      "coming_from_optax.md",
      "sharding.md",
      "variants.md",
  }


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(page):
  links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
  local = [l for l in links if not re.match(r"[a-z]+:", l)]
  missing = [l for l in local if not (page.parent / l).exists()]
  assert not missing, missing


def test_readme_fits_on_a_few_screens():
  assert len((ROOT / "README.md").read_bytes()) <= 15_000


def test_every_public_name_is_in_the_api_reference():
  api = (ROOT / "docs" / "api.rst").read_text()
  documented = set(
      re.findall(r"^\.\. auto(?:function|class|data):: (\w+)", api, re.M)
  )
  assert set(optax_muon.__all__) <= documented, (
      set(optax_muon.__all__) - documented
  )


SCRIPTS = sorted(
    [*(ROOT / "examples").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
)


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_every_command_line_option_has_help(script):
  """What ``--help`` prints: each option of each example and benchmark says what
  it does."""
  import ast  # noqa: PLC0415

  calls = [
      node
      for node in ast.walk(ast.parse(script.read_text()))
      if isinstance(node, ast.Call)
      and getattr(node.func, "attr", "") == "add_argument"
  ]
  silent = [
      ast.literal_eval(c.args[0])
      for c in calls
      if not any(k.arg == "help" for k in c.keywords)
  ]
  assert not silent, silent
