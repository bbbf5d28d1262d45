"""Benchmarks' library: workloads, offline and HTTP drivers, live cameras, soak, accuracy and paired tests."""
