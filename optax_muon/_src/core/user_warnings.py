"""Warnings that point at the user's line: the first frame outside this package
and the libraries it runs inside (optax, JAX, Flax, Equinox), whatever wraps the
transformation."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

_LIBRARIES = (
    "optax_muon",
    "optax",
    "jax",
    "jaxlib",
    "flax",
    "equinox",
    "orbax",
    "chex",
)


def _library_files() -> tuple[str, ...]:
  """Path prefixes of the libraries' files (and of ``contextlib``, whose frames
  sit between a ``with`` block and the code it wraps)."""
  prefixes = [os.path.abspath(contextlib.__file__)]
  for name in _LIBRARIES:
    path = getattr(sys.modules.get(name), "__file__", None)
    if path:
      prefixes.append(os.path.dirname(os.path.abspath(path)) + os.sep)
  return tuple(prefixes)


def _user_stacklevel() -> int:
  """The ``stacklevel`` of the first caller outside the libraries, counted from
  the caller of ``warn_at_caller``."""
  prefixes = _library_files()
  # 2: the caller of warn_at_caller.
  frame, level = sys._getframe(2), 2  # noqa: SLF001
  while frame is not None and os.path.abspath(
      frame.f_code.co_filename
  ).startswith(prefixes):
    frame, level = frame.f_back, level + 1
  return level if frame is not None else 2


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
  """``warnings.warn(message)`` attributed to the user's line."""
  warnings.warn(message, category, stacklevel=_user_stacklevel())


class OncePerTransformation:
  """Remembers what one transformation has said, so that each warning is issued
  once."""

  def __init__(self):
    self._said: set[str] = set()

  def warn(self, messages) -> None:
    for message in messages:
      if message not in self._said:
        self._said.add(message)
        warn_at_caller(message)
