"""Runs drawn from the files `meshfit train` writes (the ``chart`` extra: matplotlib).

    plot.py      ``meshfit plot``: runs' metrics (loss, validation loss, learning rate,
                 throughput, peak memory) against training tokens, several runs overlaid
    pipeline.py  ``meshfit pipeline-chart``: a pipeline run's schedule as a Gantt chart, with
                 its measured bubble beside the textbook one

Neither imports torch or matplotlib when it loads: matplotlib is asked for when drawing, and
its absence is a one-line error naming the extra.
"""
