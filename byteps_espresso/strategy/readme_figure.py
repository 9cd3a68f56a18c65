"""Redraw the README's timeline picture with the current code and print the sentence that
quotes its numbers.

    python -m byteps_espresso.strategy.readme_figure     # from the repository root

The picture is what ``espresso plan`` draws for :data:`COMMAND`, the command the README
shows. Its PNG text chunk ``Description`` holds :func:`sentence`, the README's sentence
under the picture, so a test can check that the committed picture, the README and the
current planner agree.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from byteps_espresso.strategy.cli import plan_arguments, plan_from_args, timeline_title
from byteps_espresso.strategy.strategy_file import Strategy

__all__ = ["COMMAND", "FIGURE", "main", "plan", "sentence"]

# `espresso plan` flags of the README's example (VGG16 on 8 x 8 V100 over PCIe and 25 Gbit/s).
COMMAND: tuple[str, ...] = (
    "--workload", "vgg16", "--machines", "8", "--gpus-per-machine", "8", "--intra", "pcie",
    "--inter-gbps", "25", "--compressor", "randomk", "--ratio", "0.01")
# Where the README shows the picture, relative to the repository root.
FIGURE = Path("docs") / "img" / "timeline-vgg16.png"


def plan() -> Strategy:
    """The README example's plan, made by the current code."""
    return plan_from_args(plan_arguments(COMMAND))[0]


def sentence(strategy: Strategy) -> str:
    """The README's sentence under the picture: Espresso's iteration against fp32 and the
    HiPress-like plan, in whole milliseconds."""
    fp32, hipress = strategy.baselines["fp32"], strategy.baselines["hipress"]
    return (f"It predicts {strategy.predicted_ms:.0f} ms per iteration against {fp32:.0f} ms "
            f"uncompressed ({fp32 / strategy.predicted_ms:.1f}x) and {hipress:.0f} ms for the "
            "HiPress-like plan.")


def main(argv: Sequence[str] | None = None) -> int:
    """Draw the picture to ``--out`` (default: the README's) and print the sentence."""
    from byteps_espresso.strategy.plot import draw_timelines

    parser = argparse.ArgumentParser(prog="python -m byteps_espresso.strategy.readme_figure",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIGURE, help="picture to write")
    out = parser.parse_args(argv).out
    strategy, timelines, _, _ = plan_from_args(plan_arguments(COMMAND))
    text = sentence(strategy)
    draw_timelines(timelines, out, title=timeline_title(strategy),
                   metadata={"Description": text, "Command": "espresso plan " + " ".join(COMMAND)})
    print(f"wrote {out}; the README's sentence under it:\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
