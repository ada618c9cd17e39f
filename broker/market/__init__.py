"""The market: the clouds' offers polled into one pool, recorded as history and traces,
summarised as capacity, and read as interruption hazard."""
