"""Amazon Web Services: EC2 GPU instances, spot and on-demand."""
