"""Pieces of tools/bench.py and tools/gpu_check.py: timing, configuration, workloads, the timed
paths and the report. tools/ is put on sys.path by the scripts that use it."""
