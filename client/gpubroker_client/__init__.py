"""gpubroker_client: what a scheduler needs to talk to a gpubroker daemon over MQTT, with
no dependency but aiomqtt. It also holds the two pieces the daemon shares with it: the
one reader of operator-given files (`gpubroker_client.files`) and the one MQTT URL parser
(`gpubroker_client.mqtturl`)."""
