"""How gpubroker writes: its logs, warnings rate-limited against floods, and a command's
output with user text made safe to echo. The bottom layer: it imports nothing else of the
project."""
