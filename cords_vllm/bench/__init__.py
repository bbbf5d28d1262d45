"""Throughput benchmarking of KV policies: workloads, an offline and an HTTP driver, reports and plots."""
