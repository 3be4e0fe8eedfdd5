"""One loss-curve figure style for the examples and benchmarks."""

from __future__ import annotations

import pathlib


def save_loss_plot(
    path: pathlib.Path,
    lines: list[tuple],
    ylabel: str,
    ylim: tuple[float, float] | None = None,
):
  """Writes a PNG of loss curves against the step.

  Args:
    path: where to write it.
    lines: (steps, losses, label, matplotlib keyword arguments) per curve.
    ylabel: the y-axis label.
    ylim: the y-axis range; None lets matplotlib choose.

  Returns:
    The (closed) matplotlib figure, for inspection.
  """
  import matplotlib  # noqa: PLC0415  (only the plotting path needs it)

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for steps, losses, label, style in lines:
    ax.plot(steps, losses, label=label, **style)
  ax.set_xlabel("step")
  ax.set_ylabel(ylabel)
  if ylim is not None:
    ax.set_ylim(*ylim)
  ax.set_title("Byte-level GPT on the Python standard library")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return fig
