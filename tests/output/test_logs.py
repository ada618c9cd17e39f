"""Logs are JSON lines on stdout, and no secret ever reaches them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mqtt_helpers import Mosquitto, ProbeFactory, free_port, payload_json

from broker.output.logs import redact

SECRETS = {"mqtt": "mqtt-pw-7a4e1f99", "token": "http-tok-2b8c0d11",
           "aws": "aws-secret-5e9f3a77"}


async def test_no_secret_is_ever_logged(tmp_path: Path, mosquitto: Mosquitto,
                                        probe_factory: ProbeFactory) -> None:
    (tmp_path / "mqtt").write_text(SECRETS["mqtt"])
    (tmp_path / "token").write_text(SECRETS["token"])
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({
        "log_level": "debug",
        "state": {"path": str(tmp_path / "state.db")},
        "mqtt": {"url": mosquitto.url, "username": "gpubroker",
                 "password_file": str(tmp_path / "mqtt")},
        "http": {"listen": f"127.0.0.1:{free_port()}", "token_file": str(tmp_path / "token")},
        # (AWS's first poll is retried for the whole poll timeout: keep it short)
        "poll": {"interval_seconds": 3600, "stale_after_seconds": 7200, "timeout_seconds": 3},
        # AWS against a closed port: its failure is logged, with the secret in the env.
        "clouds": {"aws": {"regions": ["us-east-1"],
                           "endpoint": f"http://127.0.0.1:{free_port()}"},
                   "sim": {"clouds": ["gcp"], "regions_per_cloud": 1}}}))
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "AKIATESTKEY", "AWS_SECRET_ACCESS_KEY":
           SECRETS["aws"], "AWS_EC2_METADATA_DISABLED": "true"}
    probe = await probe_factory(["gpubroker/v1/#"])
    out = tmp_path / "out.log"
    with out.open("wb") as f:
        proc = subprocess.Popen(  # noqa: ASYNC220 - waited on below off the loop
            [sys.executable, "-m", "broker.cli", "run", "--config", str(cfg)], env=env,
            stdout=f, stderr=subprocess.STDOUT)
        try:
            await probe.wait_for(lambda m: str(m.topic) == "gpubroker/v1/status" and m.payload
                                 and payload_json(m)["state"] == "online", timeout=30)
            await probe.publish("gpubroker/v1/requests/s1/place",
                                {"request_id": "x", "gpu": "L4", "gpus": 1})
            await probe.wait_for("gpubroker/v1/events/s1/placement.decided", timeout=10)
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = out.read_text()
    lines = [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]
    assert {"starting", "ready", "stopped"} <= {e["event"] for e in lines}
    assert any(e["event"] == "poll failing" and e.get("adapter") == "aws" for e in lines)
    for name, secret in SECRETS.items():
        assert secret not in text, f"the {name} secret was logged"


def test_fields_named_like_secrets_are_masked() -> None:
    event = {"event": "x", "password": "p", "api_token": "t", "aws_secret": "s", "ok": 1}
    assert redact(None, "info", event) == {"event": "x", "password": "***",
                                           "api_token": "***", "aws_secret": "***", "ok": 1}


def test_cloud_sdk_loggers_speak_only_at_debug(capsys: pytest.CaptureFixture[str]) -> None:
    """An SDK's credential-probe warnings and tracebacks are not shown at the levels a
    user normally runs with; at debug its warnings are, its own debug output never."""
    import logging

    import structlog

    from broker.output import logs

    saved_config = structlog.get_config()
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    saved_levels = {n: logging.getLogger(n).level for n in logs.SDK_LOGGERS}
    try:
        logs.configure(json=False, level=logging.WARNING)
        for name in ("alibabacloud_credentials", "botocore.credentials", "azure.identity"):
            logging.getLogger(name).error("probe failed", exc_info=RuntimeError("no creds"))
        logging.getLogger("gpubroker.test").warning("ours still shows")
        err = capsys.readouterr().err
        assert "probe failed" not in err and "Traceback" not in err
        assert "ours still shows" in err
        logs.configure(json=False, level=logging.DEBUG)
        logging.getLogger("alibabacloud_credentials").warning("probe warning")
        logging.getLogger("botocore.endpoint").debug("request headers")
        err = capsys.readouterr().err
        assert "probe warning" in err and "request headers" not in err
    finally:
        # What the other tests run with: never a stream this test's capture closes.
        structlog.configure(**saved_config)
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        for name, level in saved_levels.items():
            logging.getLogger(name).setLevel(level)
