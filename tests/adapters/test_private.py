"""The private adapter (`adapters/private`): the servers file, its offers, maintenance
windows and reloads, on real files. Health: test_private_health.py."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from adapters.base import CloudAdapter
from adapters.errors import InvalidConfig
from adapters.private.adapter import PrivateAdapter, from_config
from adapters.private.servers import (
    MAX_BYTES,
    MAX_SERVERS,
    SourceError,
    load_servers,
    parse_servers,
)
from broker.daemon.config import parse_config
from broker.market.clouds import build_adapters
from broker.market.pool import ResourcePool
from broker.model import Market, Offer, Placement, PoolKey, Target

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 12, 10, 0, 0, tzinfo=UTC)

SERVERS = """\
version: 1
sites:
  fra1:
    residency: [eu, de]
    zones: [hall-a, hall-b]
  ams1:
    residency: [eu]
groups:
  - name: a100-pod1
    site: fra1
    zone: hall-a
    gpu: A100-80GB
    gpus: 8
    vcpus: 96
    memory_gb: 1024
    servers: [gpu-a01, gpu-a02, gpu-a03]
    price_per_gpu_hour: 0.5
  - name: l4-rack
    site: ams1
    gpu: L4
    gpus: 4
    count: 3
    name_prefix: ams-l
    price_per_gpu_hour: 0.0
maintenance:
  - servers: [gpu-a02]
    drain_from: 2026-12-10T02:00:00Z
    drain_until: 2026-12-10T06:00:00Z
    lead_minutes: 30
    reason: BIOS update
"""


class Clock:
    """The adapter's clock, moved by the test."""

    def __init__(self, now: datetime = T0) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def problems(text: str) -> list[str]:
    with pytest.raises(SourceError) as err:
        parse_servers(text, "servers.yaml")
    return [str(p) for p in err.value.problems]


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def remove(path: Path) -> None:
    path.unlink()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def servers_file(tmp_path: Path) -> Path:
    return write(tmp_path / "servers.yaml", SERVERS)


@pytest.fixture
def adapter(servers_file: Path, clock: Clock) -> Iterator[PrivateAdapter]:
    a = PrivateAdapter(file=servers_file, clock=clock)
    yield a


async def poll(adapter: PrivateAdapter, site: str) -> dict[str, Offer]:
    return {o.pool.instance_type: o for o in await adapter.poll(site)}


# --- the file ----------------------------------------------------------------------------


def test_the_example_file_loads() -> None:
    servers = load_servers(ROOT / "deploy/private.example.yaml")
    assert sorted(servers.sites) == ["ams1", "fra1"]
    assert servers.sites["fra1"].zones == ("hall-a", "hall-b")
    assert servers.sites["ams1"].zones == ("ams1",)
    by_name = {g.name: g for g in servers.groups}
    assert by_name["h100-pod2"].servers == tuple(f"gpu-h{n:02d}" for n in range(1, 13))
    assert by_name["l40s-rack3"].zone == "ams1"
    assert servers.server_count == 17
    assert servers.residency_tags() == {"eu": ["private:fra1", "private:ams1"],
                                        "de": ["private:fra1"], "nl": ["private:ams1"]}
    window = servers.maintenance[1]
    assert window.servers == {"ams-l01", "ams-l02", "ams-l03"}
    assert window.drain_from == datetime(2026, 12, 12, 21, 0, tzinfo=UTC)
    assert window.lead == timedelta(minutes=30)


@pytest.mark.parametrize(("count", "first", "last"),
                         [(8, "n01", "n08"), (9, "n01", "n09"), (100, "n001", "n100")])
def test_counted_servers_are_numbered_zero_padded_to_the_counts_width(
        count: int, first: str, last: str) -> None:
    servers = parse_servers(f"""\
version: 1
sites: {{s: {{}}}}
groups:
  - {{name: g, site: s, gpu: T4, gpus: 1, count: {count}, name_prefix: n,
      price_per_gpu_hour: 0}}
""")
    names = servers.groups[0].servers
    assert (len(names), names[0], names[-1]) == (count, first, last)


def test_a_gpu_typo_names_line_key_and_the_model_meant() -> None:
    assert problems(SERVERS.replace("gpu: A100-80GB", "gpu: A100-80G")) == [
        "servers.yaml:12:5: groups[0].gpu: unknown GPU model 'A100-80G'; "
        "did you mean 'A100-80GB'?"]


def test_a_site_typo_names_the_site_meant() -> None:
    assert problems(SERVERS.replace("site: ams1", "site: ams")) == [
        "servers.yaml:19:5: groups[1].site: unknown site 'ams'; did you mean 'ams1'?"]


def test_every_problem_at_once_in_the_order_of_the_file() -> None:
    text = SERVERS.replace("    residency: [eu]\n", "    residncy: [eu]\n") \
        .replace("zone: hall-a\n", "zone: hall-c\n") \
        .replace("gpus: 4", "gpus: 0") \
        .replace("servers: [gpu-a02]", "servers: [gpu-a2]") \
        .replace("drain_until: 2026-12-10T06:00:00Z", "drain_until: 2026-12-10T01:00:00Z")
    assert problems(text) == [
        "servers.yaml:7:5: sites.ams1.residncy: unknown key; did you mean 'residency'?",
        "servers.yaml:11:5: groups[0].zone: site 'fra1' has no zone 'hall-c' (its zones: "
        "hall-a, hall-b); did you mean 'hall-b'?",
        "servers.yaml:21:5: groups[1].gpus: Input should be greater than or equal to 1",
        "servers.yaml:26:15: maintenance[0].servers[0]: unknown server 'gpu-a2'; "
        "did you mean 'gpu-a02'?",
        "servers.yaml:28:5: maintenance[0].drain_until: must be after drain_from",
    ]


def test_server_names_are_unique_across_the_file() -> None:
    text = SERVERS.replace("name_prefix: ams-l", "name_prefix: gpu-a")
    assert problems(text) == [
        "servers.yaml:22:5: groups[1].count: server 'gpu-a01' is already declared in group "
        "'a100-pod1' (groups[0])",
        "servers.yaml:22:5: groups[1].count: server 'gpu-a02' is already declared in group "
        "'a100-pod1' (groups[0])",
        "servers.yaml:22:5: groups[1].count: server 'gpu-a03' is already declared in group "
        "'a100-pod1' (groups[0])",
    ]
    twice = SERVERS.replace("[gpu-a01, gpu-a02, gpu-a03]", "[gpu-a01, gpu-a02, gpu-a01]")
    assert problems(twice) == [
        "servers.yaml:16:33: groups[0].servers[2]: server 'gpu-a01' is already declared in "
        "this group"]


@pytest.mark.parametrize(("change", "expected"), [
    (("    zone: hall-a\n", ""),
     "servers.yaml:9:5: groups[0].zone: site 'fra1' has several zones (hall-a, hall-b): "
     "say which"),
    (("drain_from: 2026-12-10T02:00:00Z", "drain_from: 2026-12-10T02:00:00"),
     "servers.yaml:27:5: maintenance[0].drain_from: Input should have timezone info"),
    (("    count: 3\n", "    servers: [x]\n"),
     "servers.yaml:23:5: groups[1].name_prefix: name_prefix goes with count, not servers"),
    (("    name_prefix: ams-l\n", "    name_prefix: ams-l\n    servers: [x]\n"),
     "servers.yaml:22:5: groups[1].count: give either servers (names) or count with "
     "name_prefix, not both"),
    (("- name: l4-rack", "- name: l4 rack"),
     "servers.yaml:18:5: groups[1].name: String should match pattern "
     "'^[A-Za-z0-9_.-]{1,128}$'"),
    (("  - servers: [gpu-a02]\n", "  - group: a100-pod\n"),
     "servers.yaml:26:5: maintenance[0].group: unknown group 'a100-pod'; did you mean "
     "'a100-pod1'?"),
    (("version: 1", "version: 2"), "servers.yaml:1:1: version: Input should be 1"),
    (("price_per_gpu_hour: 0.5", "price_per_gpu_hour: -1"),
     "servers.yaml:17:5: groups[0].price_per_gpu_hour: Input should be greater than or "
     "equal to 0"),
])
def test_each_rule_names_line_and_key(change: tuple[str, str], expected: str) -> None:
    text = SERVERS.replace(*change)
    assert text != SERVERS
    assert problems(text) == [expected]


def test_health_is_a_prometheus_template_or_a_file(tmp_path: Path) -> None:
    group = "    price_per_gpu_hour: 0.5\n"
    assert problems(SERVERS.replace(group, group + "    health: {}\n")) == [
        "servers.yaml:18:5: groups[0].health: give one of prometheus (an endpoint template) "
        "or file"]
    bad = SERVERS.replace(group, group + "    health: {prometheus: 'http://x:9400/m'}\n")
    assert problems(bad) == [
        "servers.yaml:18:14: groups[0].health.prometheus: must hold {server}, and nothing "
        "else in braces, e.g. http://{server}:9400/metrics"]
    relative = write(tmp_path / "servers.yaml",
                     SERVERS.replace(group, group + "    health: {file: health.yaml}\n"))
    health = load_servers(relative).groups[0].health
    assert health is not None and health.file == tmp_path / "health.yaml"


def test_sizes_are_capped() -> None:
    too_many = SERVERS.replace("count: 3", f"count: {MAX_SERVERS - 2}")
    assert problems(too_many) == [
        "servers.yaml:8:1: groups: 100,001 servers declared; at most 100,000 per file"]
    huge = SERVERS + "#" * MAX_BYTES
    assert problems(huge) == ["servers.yaml: larger than 1 MiB (1048576 bytes); not read"]
    assert problems("") == ["servers.yaml: empty file: it needs `version: 1` and `sites`"]


# --- offers ------------------------------------------------------------------------------


async def test_one_reserved_offer_per_group_with_its_servers_as_targets(
        adapter: PrivateAdapter, clock: Clock) -> None:
    assert isinstance(adapter, CloudAdapter) and adapter.name == "private"
    assert adapter.regions() == ["fra1", "ams1"]
    offers = await poll(adapter, "fra1")
    assert list(offers) == ["a100-pod1"]
    o = offers["a100-pod1"]
    assert o.pool == PoolKey("private", "fra1", "hall-a", "a100-pod1", Market.RESERVED)
    assert (o.gpu, o.gpus, o.gpu_memory_gb, o.vcpus, o.memory_gb) == \
        ("A100-80GB", 8, 80, 96, 1024)
    assert o.price_per_hour == pytest.approx(4.0) and o.price_per_gpu_hour == 0.5
    assert (o.availability, o.interruption_rate, o.capacity) == (1.0, None, 3)
    assert o.targets == (Target("gpu-a01", 1, 1), Target("gpu-a02", 1, 1),
                         Target("gpu-a03", 1, 1))
    assert o.draining == () and o.owned_gpus == 24 and o.observed_at == T0
    l4 = (await poll(adapter, "ams1"))["l4-rack"]
    assert l4.pool.zone == "ams1" and l4.price_per_hour == 0.0
    assert [t.id for t in l4.targets] == ["ams-l01", "ams-l02", "ams-l03"]
    assert adapter.residency_tags() == {"eu": ["private:fra1", "private:ams1"],
                                        "de": ["private:fra1"]}
    with pytest.raises(InvalidConfig, match="site 'nowhere'"):
        await adapter.poll("nowhere")


async def test_maintenance_lead_window_drains_then_the_window_removes_then_it_is_back(
        adapter: PrivateAdapter, clock: Clock) -> None:
    async def a100() -> Offer:
        return (await poll(adapter, "fra1"))["a100-pod1"]

    clock.now = datetime(2026, 12, 10, 1, 29, 59, tzinfo=UTC)  # before the lead time
    o = await a100()
    assert (len(o.targets), o.draining, o.capacity) == (3, (), 3)
    clock.now = datetime(2026, 12, 10, 1, 30, tzinfo=UTC)  # lead time: drains, still listed
    o = await a100()
    assert [t.id for t in o.targets] == ["gpu-a01", "gpu-a02", "gpu-a03"]
    assert (o.draining, o.capacity, o.observed_at) == (("gpu-a02",), 2, clock.now)
    clock.now = datetime(2026, 12, 10, 2, 0, tzinfo=UTC)  # inside the window: gone
    o = await a100()
    assert ([t.id for t in o.targets], o.draining, o.capacity) == \
        (["gpu-a01", "gpu-a03"], (), 2)
    clock.now = datetime(2026, 12, 10, 5, 59, 59, tzinfo=UTC)
    assert "gpu-a02" not in [t.id for t in (await a100()).targets]
    clock.now = datetime(2026, 12, 10, 6, 0, tzinfo=UTC)  # after: back
    o = await a100()
    assert (len(o.targets), o.draining, o.capacity) == (3, (), 3)


async def test_the_pool_assigns_servers_that_are_not_draining(
        adapter: PrivateAdapter, clock: Clock) -> None:
    clock.now = datetime(2026, 12, 10, 1, 45, tzinfo=UTC)
    offers = await adapter.poll("fra1")
    pool = ResourcePool(stale_after_seconds=300, clock=clock)
    pool.replace(("private", "fra1"), offers)
    taken = pool.take(Placement.of(offers[0], 2))
    assert taken.targets == (("gpu-a01", 1), ("gpu-a03", 1))
    assert pool.free_capacity(offers[0].pool) == 0


async def test_sliced_servers_are_leased_a_slice_at_a_time(
        tmp_path: Path, clock: Clock) -> None:
    """`slices: 4`: four 2-GPU instances per server; small leases share a server and a
    lease of several slices fills one server before the next."""
    file = write(tmp_path / "servers.yaml", SERVERS.replace(
        "    price_per_gpu_hour: 0.5\n", "    price_per_gpu_hour: 0.5\n    slices: 4\n", 1))
    [o] = await PrivateAdapter(file=file, clock=clock).poll("fra1")
    assert (o.gpus, o.vcpus, o.memory_gb, o.capacity, o.owned_gpus) == (2, 24, 256, 12, 24)
    assert o.price_per_gpu_hour == 0.5
    assert o.targets[0] == Target("gpu-a01", 4, 4)
    pool = ResourcePool(stale_after_seconds=300, clock=clock)
    pool.replace(("private", "fra1"), [o])
    assert pool.take(Placement.of(o, 1)).targets == (("gpu-a01", 1),)
    # Four slices: a whole free server, not the three left on the first and one more.
    assert pool.take(Placement.of(o, 4)).targets == (("gpu-a02", 4),)
    assert pool.take(Placement.of(o, 2)).targets == (("gpu-a01", 2),)  # the snuggest
    assert pool.free_capacity(o.pool) == 5 and pool.idle_owned_gpus() == 10
    # Five: no server has room for all; in order, as far as each has room.
    assert pool.take(Placement.of(o, 5)).targets == (("gpu-a01", 1), ("gpu-a03", 4))
    assert pool.free_capacity(o.pool) == 0 and pool.idle_owned_gpus() == 0
    assert problems(SERVERS.replace("    price_per_gpu_hour: 0.5\n",
                                    "    price_per_gpu_hour: 0.5\n    slices: 3\n", 1)) == \
        ["servers.yaml:18:5: groups[0].slices: 3 slices do not divide the server's 8 GPUs"]


# --- reload ------------------------------------------------------------------------------


async def test_a_changed_file_is_read_at_the_next_poll(
        adapter: PrivateAdapter, servers_file: Path) -> None:
    assert (await poll(adapter, "fra1"))["a100-pod1"].price_per_hour == 4.0
    # Same size, same second: read again all the same.
    write(servers_file, SERVERS.replace("price_per_gpu_hour: 0.5", "price_per_gpu_hour: 0.7"))
    with capture_logs() as logs:
        assert (await poll(adapter, "fra1"))["a100-pod1"].price_per_hour == \
            pytest.approx(5.6)
        assert (await poll(adapter, "ams1"))["l4-rack"].capacity == 3
    assert [e["event"] for e in logs] == ["private servers file reloaded"]


async def test_a_broken_file_is_logged_once_and_the_last_good_one_kept(
        adapter: PrivateAdapter, servers_file: Path) -> None:
    await poll(adapter, "fra1")
    write(servers_file, SERVERS.replace("gpu: A100-80GB", "gpu: A100-80G"))
    with capture_logs() as logs:
        for _ in range(3):
            o = (await poll(adapter, "fra1"))["a100-pod1"]
            assert o.gpu == "A100-80GB" and len(o.targets) == 3
    assert logs == [{
        "event": "private servers file has errors; keeping the last good one",
        "log_level": "error", "file": str(servers_file), "count": 1,
        "problems": [f"{servers_file}:12:5: groups[0].gpu: unknown GPU model 'A100-80G'; "
                     "did you mean 'A100-80GB'?"]}]
    write(servers_file, SERVERS.replace("gpus: 8", "gpus: 4"))
    with capture_logs() as logs:
        assert (await poll(adapter, "fra1"))["a100-pod1"].gpus == 4
    assert [e["event"] for e in logs] == ["private servers file reloaded"]


async def test_a_file_gone_later_keeps_the_last_good_one(
        adapter: PrivateAdapter, servers_file: Path) -> None:
    await poll(adapter, "fra1")
    remove(servers_file)
    with capture_logs() as logs:
        for _ in range(2):
            assert len((await poll(adapter, "fra1"))["a100-pod1"].targets) == 3
    assert [(e["event"], e["why"]) for e in logs] == [
        ("private servers file unreadable; keeping the last good one",
         "No such file or directory")]
    write(servers_file, SERVERS.replace("gpus: 8", "gpus: 2"))
    with capture_logs() as logs:
        assert (await poll(adapter, "fra1"))["a100-pod1"].gpus == 2
    assert [e["event"] for e in logs] == ["private servers file readable again",
                                          "private servers file reloaded"]


async def test_sites_removed_are_polled_empty_and_sites_added_wait_for_a_restart(
        adapter: PrivateAdapter, servers_file: Path) -> None:
    text = SERVERS.replace("  ams1:\n    residency: [eu]\n", "  ber1: {}\n") \
        .replace("site: ams1", "site: ber1")
    write(servers_file, text)
    with capture_logs() as logs:
        assert await adapter.poll("ams1") == []
    assert [(e["event"], e.get("sites")) for e in logs] == [
        ("private sites added to the servers file are polled from the next start", ["ber1"]),
        ("private servers file reloaded", 2)]
    assert logs[1]["sites_removed"] == ["ams1"]
    assert adapter.regions() == ["fra1", "ams1"]


def test_a_missing_or_broken_file_at_start_is_an_invalid_config(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig, match=r"clouds.private.file: .*nope.yaml: no such file"):
        PrivateAdapter(file=tmp_path / "nope.yaml")
    broken = write(tmp_path / "servers.yaml", SERVERS.replace("site: ams1", "site: ams"))
    with pytest.raises(InvalidConfig, match=r"servers.yaml:19:5: groups\[1\].site: unknown"):
        PrivateAdapter(file=broken)


async def test_the_daemon_builds_it_from_its_configuration(servers_file: Path,
                                                           tmp_path: Path) -> None:
    cfg = parse_config(f"clouds:\n  private:\n    file: {servers_file}\n"
                       "    health_timeout_seconds: 1.5\n")
    adapters, problems_ = build_adapters(cfg)
    assert problems_ == [] and [a.name for a in adapters] == ["private"]
    built = adapters[0]
    assert isinstance(built, PrivateAdapter)
    assert built.health.prober.timeout == 1.5
    await built.close()
    assert cfg.clouds.private is not None
    assert isinstance(from_config(cfg.clouds.private), PrivateAdapter)
    missing = parse_config(f"clouds:\n  private:\n    file: {tmp_path / 'gone.yaml'}\n")
    adapters, problems_ = build_adapters(missing)
    assert adapters == []
    assert problems_ == [("private", f"clouds.private.file: {tmp_path / 'gone.yaml'}: "
                                     "no such file")]


def test_a_watched_file_tells_a_change_of_content_only(servers_file: Path) -> None:
    from adapters.private.files import WatchedFile

    watched = WatchedFile(servers_file, MAX_BYTES)
    assert watched.read() == SERVERS.encode()
    assert watched.changed() is None
    write(servers_file, SERVERS)  # written again, the same
    assert watched.changed() is None
    same_size = SERVERS.replace("gpus: 8", "gpus: 9")
    write(servers_file, same_size)  # in the same clock tick, most likely
    assert watched.changed() == same_size.encode()
    assert watched.changed() is None
    remove(servers_file)
    with pytest.raises(FileNotFoundError):
        watched.changed()
    write(servers_file, same_size)  # back, as it was: news all the same
    assert watched.changed() == same_size.encode()
