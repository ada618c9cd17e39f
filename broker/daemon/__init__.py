"""The daemon: its configuration, its logs, the files it reads, and the assembly that
builds the parts and runs them."""
