"""Alibaba Cloud: ECS GPU instances, preemptible (spot) and pay-as-you-go."""
