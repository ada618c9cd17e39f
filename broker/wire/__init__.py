"""The wire: what schedulers send, validated; every payload as a type; the MQTT messages
and their envelope; and the contract generated from them."""
