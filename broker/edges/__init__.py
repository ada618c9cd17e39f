"""The daemon's edges to the world: the MQTT bus, the HTTP API, the Prometheus metrics
and systemd's notifications."""
