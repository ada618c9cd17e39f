"""Leasing: the lease book, the authority that turns requests into lease changes and
events, and the failover that moves leases whose capacity goes away."""
