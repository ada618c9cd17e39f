"""Google Cloud: Compute Engine GPU machine types and N1 + GPU shapes, Spot and on-demand."""
