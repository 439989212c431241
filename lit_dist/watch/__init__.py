"""Watching a run: ``tensorboard.py`` (the default logger), ``perf.py`` (FLOPs, peaks, throughput), ``goodput.py``
(where the wall time went), ``report.py`` (``lit-dist report``), ``scaling.py`` (``lit-dist scale``) and
``console.py`` (whole lines from every rank; Lightning's messages that say nothing about the run left out)."""
