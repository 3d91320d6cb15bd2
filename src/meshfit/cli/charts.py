"""``meshfit plot`` (runs' metrics drawn: `meshfit.train.plot`) and ``meshfit
pipeline-chart`` (a pipeline run's schedule as a Gantt chart with its measured bubble:
`meshfit.train.pipeline_chart`): their arguments and what they print."""

from __future__ import annotations

from meshfit.cli import OneLineParser

__all__ = ["cmd_pipeline_chart", "cmd_plot"]


def cmd_pipeline_chart(argv: list[str]) -> int:
    from meshfit.train.pipeline_chart import describe, draw

    p = OneLineParser("meshfit pipeline-chart", "Draw a pipeline-parallel run's schedule (one "
                      "row per pp rank) and print its measured bubble beside the theoretical "
                      "one.")
    p.add_argument("run", metavar="RUN", help="the run folder of a `meshfit train` with pp > 1")
    p.add_argument("--out", metavar="PNG", default=None,
                   help="the chart's path (default: RUN/pipeline_chart.png)")
    p.add_argument("--step", metavar="N", type=int, default=None,
                   help="the step to draw (default: the last recorded)")
    ns = p.parse_args(argv)
    png, summary = draw(ns.run, ns.out, step=ns.step)
    for line in describe(summary):
        print(line)
    print(f"chart of step {summary['step']}: {png}")
    return 0


def cmd_plot(argv: list[str]) -> int:
    from meshfit.train.plot import DPI, FIGSIZE, describe, draw

    p = OneLineParser(
        "meshfit plot", "Draw runs of `meshfit train` from their metrics.jsonl, overlaid and "
        "labelled with their folder names: loss and validation loss, learning rate, "
        "throughput and peak memory against training tokens (step x global batch x seq_len "
        f"from each run's config.toml); a {FIGSIZE[0] * DPI:.0f} x {FIGSIZE[1] * DPI:.0f} PNG "
        '(or .pdf/.svg). Needs matplotlib: pip install "meshfit[chart]".')
    p.add_argument("runs", metavar="RUN", nargs="+", help="run folders (meshfit train --out)")
    p.add_argument("-o", "--out", metavar="FILE", default=None,
                   help="where the plot goes (default: RUN/metrics.png for one run, "
                        "meshfit-plot.png here for several)")
    ns = p.parse_args(argv)
    out, runs = draw(ns.runs, ns.out)
    for run in runs:
        print(describe(run))
    print(f"meshfit plot: wrote {out}")
    return 0
