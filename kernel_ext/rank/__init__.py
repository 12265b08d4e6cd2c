"""One rank: the forked process that runs the cell, its stdout/stderr and tqdm bars."""
