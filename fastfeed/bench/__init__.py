"""The benchmark harness behind ``fastfeed bench``: fastfeed against torch's DataLoader in the same run.

- ``runner``: what the suites import, over ``trial`` (how one trial is timed), ``accounting`` (memory and CPU of
  the process tree), ``comparison`` (interleaved rounds), ``summary`` (ratios to torch with their min-max),
  ``results`` (a script's JSON and CSV), ``flags`` and ``session``;
- ``workloads`` and ``images``: the standard datasets; ``suites/``: one module per standard workload (each also a
  script under ``benchmarks/``), ``user``: the user's own dataset as a workload; ``extras``: what a workload needs
  beyond the base install;
- ``report``: one JSON report per run, its CSV, README-ready markdown and the comparison of two reports;
- ``plot``: PNG plots of a report; ``cli``: the command.

Figures only: the project's own targets for them live in ``benchmarks/targets.py``.
"""
