"""The benchmark harness behind ``fastfeed bench``: fastfeed against torch's DataLoader in the same run.

- ``runner``: interleaved rounds of trials, the figures (throughput, CPU, memory, time to first batch,
  stall), summaries as ratios to torch with their min-max;
- ``workloads``: the standard datasets; ``suites/``: one module per standard workload (each also a script
  under ``benchmarks/``), ``user``: the user's own dataset as a workload;
- ``report``: one JSON report per run, its CSV, README-ready markdown and the comparison of two reports;
- ``plot``: PNG plots of a report; ``cli``: the command.
"""
