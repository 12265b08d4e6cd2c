"""``--launcher slurm``: the agent on each node of the allocation, started by the
kernel with srun; it runs that node's launcher process for the kernel."""
