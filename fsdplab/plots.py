"""Figure conventions shared by the lessons: one place that saves the figures the README shows."""

from __future__ import annotations

import os
from pathlib import Path

FIGURE_DIR = Path(os.environ.get("FSDPLAB_FIGURES", Path(__file__).resolve().parent.parent / "docs" / "figures"))

GIB = 1024 ** 3
MIB = 1024 ** 2


def save_figure(fig, name: str, dpi: int = 110) -> Path:
    """Save `fig` as docs/figures/NAME.png (the README's pictures; `fsdplab run` regenerates them)."""
    FIGURE_DIR.mkdir(parents=True, exist_ok=True)
    path = FIGURE_DIR / f"{name}.png"
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path
