"""The sglang engine driver for the self-test: its own scheduler loop, workload and faults."""
