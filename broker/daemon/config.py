"""The daemon's configuration (SPEC §6): load, validate, explain errors.

Every problem is reported at once, one line each, naming file, line and key; the CLI
exits with code 2. Unknown keys are errors (a typo must not silently do nothing).
Credentials are never read from this file: only paths to credential files.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gpubroker_client.mqtturl import parse_mqtt_url
from policies import yamlsrc
from policies.yamlsrc import SourceError

__all__ = ["Config", "SourceError", "default_state_path", "load_config", "parse_config"]

SimCloud = Literal["aws", "gcp", "azure", "alibaba"]
SIM_CLOUDS: tuple[SimCloud, ...] = ("aws", "gcp", "azure", "alibaba")
_Region = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]


def default_state_path() -> Path:
    """systemd's StateDirectory when set, else the XDG state directory."""
    if state_dir := os.environ.get("STATE_DIRECTORY"):
        return Path(state_dir.split(":")[0]) / "state.db"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpubroker" / "state.db"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StateConfig(_Section):
    path: Path = Field(default_factory=default_state_path)
    synchronous: Literal["normal", "full"] = "full"
    keep_ended_hours: float = Field(default=24, gt=0)
    market_history_days: float = Field(default=14, ge=0, le=3650)
    """How long the market history (broker/market/recorder.py) is kept; 0 turns recording off
    (history already recorded is then left as it is)."""
    url: str | None = None
    """`postgresql://USER@HOST:PORT/DB[?sslmode=…]`: the state on PostgreSQL, shared by
    every daemon of the site, one of which leads (high availability, broker/state/leadership.py);
    replaces `path`."""
    password_file: Path | None = None
    """The PostgreSQL password; without it libpq's own sources (PGPASSWORD, ~/.pgpass)."""
    leadership_seconds: float = Field(default=3.0, ge=1.0, le=60.0)
    """How long a leader's claim lasts without renewal: a standby takes over within
    about this long after the leader dies or loses the database."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        u = urlsplit(v)
        if u.scheme not in ("postgresql", "postgres"):
            raise ValueError("must look like postgresql://USER@HOST:PORT/DATABASE")
        try:
            _ = u.port
        except ValueError:
            raise ValueError("port must be a number from 1 to 65535") from None
        if u.password or re.search(r"(^|[?&])password=", u.query):
            raise ValueError("put no password in the URL: use state.password_file or "
                             "libpq's PGPASSWORD / ~/.pgpass")
        return v


class MqttConfig(_Section):
    url: str = "mqtt://127.0.0.1:1883"
    topic_prefix: str = "gpubroker/v1"
    client_id: str | None = None
    username: str | None = None
    password_file: Path | None = None
    ca_file: Path | None = None
    protocol: Literal["5", "3.1.1"] = "5"
    session_expiry_seconds: int = Field(default=3600, ge=0)
    """How long the MQTT server keeps the daemon's session (its subscription and the
    requests queued for it) after a disconnect; MQTT 3.1.1 keeps it for good. 0 keeps
    none, on either version: a clean session (MQTT 5 clean start; 3.1.1 clean_session),
    as `gpubroker demo` uses."""
    reconnect_grace_seconds: float = Field(default=60, ge=0)
    """No lease expires while the daemon's MQTT session is down; when it is up again (and
    at start, and when a standby takes over: each is a connect), every active lease that
    would expire within this long gets this long from the connect, so that schedulers
    whose renewals went into the lost connection have time to renew. 0: none."""
    standby_username: str | None = Field(default=None, min_length=1)
    """High availability: the MQTT user a standby node follows `P/status` as (read-only;
    deploy/mosquitto/acl: `gpubroker-standby`). Never `username`: on a server that makes
    each client's id its username (deploy/mosquitto: use_username_as_clientid), a
    standby connecting as the daemon's user would end the leader's connection and discard
    the site's session. Without it a standby follows `P/status` with the daemon's own
    settings only on a server without logins (no `username`: nothing to bind ids to);
    with `username` set it does not connect to the MQTT server at all."""
    standby_password_file: Path | None = None
    """That user's password (systemd `LoadCredential`)."""

    @field_validator("standby_username")
    @classmethod
    def _standby_user(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and v == info.data.get("username"):
            raise ValueError("must not be mqtt.username: on a server that binds client ids "
                             "to usernames (deploy/mosquitto) a standby logged in as the "
                             "daemon's user would end the leader's connection and session")
        return v

    @field_validator("standby_password_file")
    @classmethod
    def _standby_password(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        if v is not None and info.data.get("standby_username") is None:
            raise ValueError("needs mqtt.standby_username (whose password it is)")
        return v

    @field_validator("protocol", mode="before")
    @classmethod
    def _protocol(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        u = urlsplit(v)
        if u.scheme not in ("mqtt", "mqtts") or not u.hostname:
            raise ValueError("must look like mqtt://HOST[:PORT] or mqtts://HOST[:PORT]")
        try:
            port = u.port
        except ValueError:
            port = 0
        if port == 0:
            raise ValueError("port must be a number from 1 to 65535")
        if u.username or u.password:
            raise ValueError("put no credentials in the URL: use username and password_file")
        try:  # what the client's parser refuses besides (the host, a path)
            parse_mqtt_url(v)
        except ValueError as exc:
            raise ValueError(str(exc).split(": ", 1)[-1]) from None
        return v

    @field_validator("topic_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v or v.startswith("/") or v.endswith("/") or any(c in v for c in "+#\0"):
            raise ValueError("must be a topic path without wildcards or leading/trailing '/'")
        return v

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        u = urlsplit(self.url)
        return u.port or (8883 if u.scheme == "mqtts" else 1883)

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme == "mqtts"

    def standby(self) -> MqttConfig | None:
        """What a standby node follows `P/status` with: these settings with the standby
        user's login; these settings as they are when the server wants no login; None
        (do not connect) when it wants one and no standby user is configured, since
        the daemon's own login may be the leader's session (see `standby_username`)."""
        if self.standby_username is None:
            return self if self.username is None else None
        return self.model_copy(update={
            "username": self.standby_username, "password_file": self.standby_password_file,
            "standby_username": None, "standby_password_file": None})


class HttpConfig(_Section):
    listen: str | None = "127.0.0.1:9464"
    """HOST:PORT, loopback by default; null turns HTTP off."""
    token_file: Path | None = None
    """A file holding the bearer token for POST /v1/requests/{S}/place (systemd:
    LoadCredential). Without it, placing over HTTP is refused."""
    views_need_token: bool = False
    """The read-only views (/v1/offers, /v1/leases, /v1/policy) ask for the bearer token
    too; /livez, /readyz and /metrics never do. Off by default, as the contract had it
    (and `gpubroker leases --http` sends none); turn it on before opening the listener
    beyond loopback, e.g. for Prometheus to scrape /metrics."""
    header_timeout_seconds: float = Field(default=10, gt=0, le=3600)
    """A connection must have sent a request's whole header this long after it opened
    or after its previous answer, or it is closed: a slow or idle client cannot hold a
    file descriptor for long (and keep-alive lasts this long)."""
    body_timeout_seconds: float = Field(default=10, gt=0, le=3600)
    """How long reading a request's body may take (POST /v1/requests/{S}/place): 408."""
    max_connections: int | None = Field(default=None, ge=1, le=1_000_000)
    """Open HTTP connections at most; default from the open-file limit (broker/edges/http.py
    `connection_limit`), so HTTP clients never take the descriptors the daemon needs.
    Beyond it a new connection replaces the oldest one with no request in progress, or
    is answered 503 and closed."""

    @model_validator(mode="after")
    def _views_token(self) -> HttpConfig:
        if self.views_need_token and self.token_file is None:
            raise ValueError("views_need_token needs http.token_file (the token to ask for)")
        return self

    @property
    def host_port(self) -> tuple[str, int] | None:
        if self.listen is None:
            return None
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str | None) -> str | None:
        if v is None:
            return None
        m = re.fullmatch(r"(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", v)
        if not m:
            raise ValueError("must be HOST:PORT, e.g. 127.0.0.1:9464")
        if not 1 <= int(m.group(2)) <= 65535:
            raise ValueError("port must be a number from 1 to 65535")
        return v


class PollConfig(_Section):
    interval_seconds: float = Field(default=60, gt=0, le=86400)
    stale_after_seconds: float = Field(default=300, gt=0)
    timeout_seconds: float = Field(default=30, gt=0)

    @model_validator(mode="after")
    def _stale(self) -> PollConfig:
        if self.stale_after_seconds < self.interval_seconds:
            raise ValueError("stale_after_seconds must be at least interval_seconds")
        return self


class PlacementConfig(_Section):
    """How requests are batched and solved (README "Placement")."""

    batch_window_ms: float = Field(default=5, ge=0, le=1000)
    """When a burst is waiting (broker.leasing.authority.BURST requests or more), gather for up to
    this long more and place them together; otherwise what is waiting goes at once."""
    max_batch: int = Field(default=256, ge=1, le=10_000)
    exact_max_batch: int = Field(default=200, ge=0, le=10_000)
    """Batches up to this size that the heuristic cannot prove optimal go to the MILP."""
    exact_time_limit_seconds: float = Field(default=0.1, ge=0, le=60)
    solve_budget_seconds: float = Field(default=2.0, gt=0, le=600)
    """The whole solve of a batch after its first feasible answer: improvement and the
    MILP stop when it is spent (the answer so far is kept)."""


class ReservationsConfig(_Section):
    """The cloud's capacity reservations, offered in the `reserved` market."""

    enabled: bool = True
    price_per_gpu_hour: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """What a GPU-hour in a reservation costs at the margin: 0 when it is paid for
    whether used or not (the usual case); the on-demand rate less a discount, say, when
    an unused reservation is refunded or resold."""


class _CloudBase(_Section):
    regions: list[_Region] = Field(default_factory=list)
    endpoint: str | None = None
    anonymous: bool = False
    call_timeout_seconds: float = Field(default=10, gt=0, le=300)
    """How long one API call may take (connect + read) before it counts as a timeout,
    which the SDK seam retries within the poll's deadline (`poll.timeout_seconds`)."""

    @model_validator(mode="after")
    def _anon(self) -> _CloudBase:
        if self.anonymous and not self.endpoint:
            raise ValueError("anonymous: true is allowed only together with endpoint")
        return self

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        return None if v is None else _http_url(v)


def _http_url(v: str) -> str:
    """`v` if it is an http:// or https:// URL with a host (and a valid port)."""
    u = urlsplit(v)
    try:
        port_ok = u.port is None or u.port > 0
    except ValueError:
        port_ok = False
    if u.scheme not in ("http", "https") or not u.hostname or " " in v or not port_ok:
        raise ValueError("must be an http:// or https:// URL with a host, e.g. "
                         "https://ec2.us-east-1.amazonaws.com")
    return v


class AwsConfig(_CloudBase):
    reservations: ReservationsConfig = Field(default_factory=ReservationsConfig)
    interruption_queue_url: str | None = None
    """The SQS queue EventBridge sends EC2 interruption warnings to (README "AWS")."""

    @field_validator("interruption_queue_url")
    @classmethod
    def _queue(cls, v: str | None) -> str | None:
        return None if v is None else _http_url(v)


class GcpConfig(_CloudBase):
    reservations: ReservationsConfig = Field(default_factory=ReservationsConfig)
    project: str | None = None


class AzureConfig(_CloudBase):
    reservations: ReservationsConfig = Field(default_factory=ReservationsConfig)
    subscription_id: Annotated[str, Field(min_length=1)]
    """Required: the subscription whose quotas and offers are read."""


class AlibabaConfig(_CloudBase):
    usd_per_cny: float = Field(default=0.14, gt=0)
    spot_duration: Literal[0, 1] = 1
    """Hours of protection of the spot instances priced (`SpotDuration`): 1, Alibaba's
    default, or 0 (no protection period, a different price)."""


class SimConfig(_Section):
    seed: int = 7
    clouds: list[SimCloud] = Field(default_factory=lambda: list(SIM_CLOUDS))
    regions_per_cloud: int = Field(default=3, ge=1, le=500)
    zones_per_region: int = Field(default=3, ge=1, le=10)
    preempt_rate_multiplier: float = Field(default=1.0, ge=0)
    signal_interval_seconds: float = Field(default=1.0, gt=0)


class PrivateConfig(_Section):
    """The company's own GPU servers (adapters.private): declared in `file`, which is
    read again whenever it changes (a file with errors is reported and the last good
    one kept)."""

    file: Path
    health_timeout_seconds: float = Field(default=3.0, gt=0, le=60)
    """How long a server's health endpoint may take to answer before the server counts
    as not answering."""


class CloudsConfig(_Section):
    """Each cloud section is optional; an empty one (`sim:`) means its defaults."""

    aws: AwsConfig | None = None
    gcp: GcpConfig | None = None
    azure: AzureConfig | None = None
    alibaba: AlibabaConfig | None = None
    private: PrivateConfig | None = None
    sim: SimConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _empty_means_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: ({} if v is None else v) for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _overlap(self) -> CloudsConfig:
        if self.sim:
            clash = [c for c in self.sim.clouds if getattr(self, c) is not None]
            if clash:
                raise ValueError(
                    f"sim.clouds simulates {', '.join(clash)}, which is also configured as a "
                    "real cloud; remove one of them")
        return self

    def configured(self) -> list[str]:
        return [n for n in ("aws", "gcp", "azure", "alibaba", "private", "sim")
                if getattr(self, n)]


def _hostname() -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:64]
    return name or "node"


class Config(_Section):
    site: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = "local"
    node: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = Field(
        default_factory=_hostname)
    """This daemon's name within its site (high availability): default the host name."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    state: StateConfig = Field(default_factory=StateConfig)
    mqtt: MqttConfig = Field(default_factory=MqttConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    policy_file: Path | None = None
    poll: PollConfig = Field(default_factory=PollConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    clouds: CloudsConfig = Field(default_factory=lambda: CloudsConfig(sim=SimConfig()))

    @field_validator("clouds", mode="before")
    @classmethod
    def _no_clouds(cls, v: Any) -> Any:
        return {} if v is None else v

    @property
    def client_id(self) -> str:
        return self.mqtt.client_id or f"gpubroker-{self.site}"


def parse_config(text: str, name: str = "<config>") -> Config:
    return _validate(yamlsrc.parse(text, name))


def load_config(path: Path) -> Config:
    return _validate(yamlsrc.load(path))


def _validate(doc: yamlsrc.Document) -> Config:
    data: Any = doc.data if doc.data is not None else {}
    if not isinstance(data, dict):
        raise SourceError([doc.problem((), "the configuration is a YAML mapping")])
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise yamlsrc.from_validation_error(doc, err, Config) from None
