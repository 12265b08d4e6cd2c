"""``%distributed_doctor``'s engine: what a launch depends on here, checked
without IPython and without initialising CUDA.

``probes`` reads the machine, ``checks`` judges what it read (plain
functions), ``explain`` tells a rank's failure that one of them explains.
"""
