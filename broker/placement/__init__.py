"""Placement: the rules an offer must pass, the cost it is ranked by, the candidates, the
solver of a batch, and the explanation of a decision."""
