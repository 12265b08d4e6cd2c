"""Runs in the Jupyter kernel: launch runs, read their signed messages, stop them,
sessions and background runs, and the kernel side of ``--launcher slurm``."""
