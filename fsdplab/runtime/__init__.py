"""The runtime behind the notebook: a live multi-rank process group, its calls, its faults and its launchers.
fsdplab.runtime.cluster's docstring maps the files."""
