"""Every Python block of the README runs as written (copy-paste examples stay true)."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, capsys):
  exec(compile(BLOCKS[index], f"README block {index}", "exec"), {})  # noqa: S102
  capsys.readouterr()


def test_readme_has_the_blocks():
  assert len(BLOCKS) >= 4
