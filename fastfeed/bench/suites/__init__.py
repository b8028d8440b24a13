"""One module per standard workload of ``fastfeed bench``; each is also a script under ``benchmarks/``."""
