"""The benchmark harnesses (run as scripts); a package, so `benchmarks.common` and the rest
resolve to this checkout's files whatever else is installed."""
