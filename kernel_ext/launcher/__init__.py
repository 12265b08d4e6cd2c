"""The launcher process (``python -m accel_magics.kernel_ext.launcher.zygote``): one
per kernel, or per node under Slurm; imports torch once and forks each run's supervisor."""
