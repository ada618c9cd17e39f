"""Azure: GPU VM sizes, restrictions, quotas, Spot and pay-as-you-go prices, Spot
eviction rates (see `adapter.py`)."""
