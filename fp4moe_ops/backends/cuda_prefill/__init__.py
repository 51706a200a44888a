"""Prefill GEMMs of the NVFP4 experts in hand-written CUDA for Hopper: an issue-17 experiment, kept
as the measurement of record and not used by any backend (benchmarks/NOTES.md, twenty-fourth
session). ``prefill.cu`` is the kernel source, ``prefill.py`` compiles (NVRTC) and launches it.
"""
