"""`hpcrl plot`: the figures exist, are valid PNGs and show something (many distinct colours)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from matplotlib import image

from hpcrl import runs
from hpcrl.inspection import InspectError
from hpcrl.plots import write_plots
from tests import synthetic_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FIGURES = ["reward.png", "kl_clipfrac.png", "response_length.png", "stage_timings.png", "timeline.png"]


def assert_real_png(path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 300 and pixels.shape[1] > 600, pixels.shape
    colours = np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)
    assert len(colours) > 50, f"{path}: only {len(colours)} distinct colours"
    assert (pixels[..., :3] < 0.5).mean() > 0.002, f"{path}: almost no dark pixels (no text, no lines)"


def test_plot_command_writes_readable_pngs(tmp_path):
    run = synthetic_run.make_run(tmp_path / "r", iterations=6, rows=64, val_rows=8, eval_every=2,
                                 kl_coef=0.05, group_size=4)
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "plot", str(run.root)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(run.root / "plots" / f) for f in FIGURES]
    for name in FIGURES:
        assert_real_png(run.root / "plots" / name)


def test_write_plots_for_the_controller(tmp_path):
    run = synthetic_run.make_run(tmp_path / "r", iterations=2, rows=16, val_rows=0, group_size=4)
    _, exp = runs.open_run(run.root)
    paths = write_plots(run, exp, tmp_path / "figures")
    assert [p.name for p in paths] == FIGURES and all(p.parent == tmp_path / "figures" for p in paths)
    for p in paths:
        assert_real_png(p)


def test_nothing_to_plot_is_a_clear_refusal(tmp_path):
    synthetic_run.write_config(tmp_path / "empty", iterations=2)
    run, exp = runs.open_run(tmp_path / "empty")
    with pytest.raises(InspectError, match="no committed stage yet"):
        write_plots(run, exp, tmp_path / "out")
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "plot", str(run.root)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "nothing to plot" in out.stderr and "Traceback" not in out.stderr
