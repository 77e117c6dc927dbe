"""Sizes, each unit under one name. Binary units count powers of two, as torch and memory do
(torch's ``bucket_cap_mb`` counts MiB; a GPU's 80 GB are 80 GiB); decimal units count powers
of ten, as papers and links do (the ZeRO paper's GB, a link's GB/s)."""

KIB, MIB, GIB = 2**10, 2**20, 2**30
KB, MB, GB = 1e3, 1e6, 1e9

__all__ = ["GB", "GIB", "KB", "KIB", "MB", "MIB"]
