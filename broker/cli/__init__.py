"""The `gpubroker` command line and the demo, on top of everything else."""
