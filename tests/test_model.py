"""Tests of the shared vocabulary's in-memory form (`broker/model.py`): what a request and
a lease share with others (#31), and that their JSON does not change with it."""

from __future__ import annotations

import copy
import json
import pickle

from factories import T0, offer, placement

from broker.leasing.book import LeaseBook
from broker.model import NO_LABELS, PlaceRequest
from broker.state.schema import lease_from, lease_row
from broker.wire.validation import parse_place


def decoded(scheduler: str, **body: object) -> PlaceRequest:
    """A request as the daemon gets it: the topic's scheduler and the body's strings
    are new objects for each message."""
    req = parse_place("/".join(("P", "requests", scheduler, "place")).split("/")[2],
                      json.dumps(body).encode())
    assert isinstance(req, PlaceRequest), req
    return req


def test_requests_share_their_repeated_names_and_no_labels() -> None:
    one = decoded("slurm-eu", request_id="a", gpu="H100-80GB", gpus=8, market="spot",
                  team="research")
    two = decoded("slurm-eu", request_id="b", gpu="H100-80GB", gpus=8, market="spot",
                  team="research")
    assert one.scheduler is two.scheduler
    assert one.team is two.team
    assert one.market is two.market
    assert one.gpu is two.gpu == ("H100-80GB",)
    assert one.labels is two.labels is NO_LABELS
    three = decoded("slurm-eu", request_id="c", gpu=["A100-80GB", "my-gpu"], gpus=1)
    four = decoded("slurm-eu", request_id="d", gpu=["A100-80GB", "my-gpu"], gpus=1)
    assert three.gpu == four.gpu == ("A100-80GB", "my-gpu")
    assert three.gpu[1] is four.gpu[1]


def test_shared_values_change_neither_equality_nor_json() -> None:
    plain = PlaceRequest(scheduler="s", request_id="r", gpu=("L4",), gpus=1, labels={})
    assert plain.labels is NO_LABELS
    assert plain == PlaceRequest(scheduler="s", request_id="r", gpu=("L4",), gpus=1)
    assert plain.labels == {}
    assert "labels" not in plain.to_json()
    labelled = PlaceRequest(scheduler="s", request_id="r", gpu=("L4",), gpus=1,
                            labels={"job": "llm"})
    assert labelled.to_json()["labels"] == {"job": "llm"}
    assert PlaceRequest.from_json("s", labelled.to_json()) == labelled
    assert PlaceRequest.from_json("s", plain.to_json()) == plain


def test_requests_and_leases_pickle_and_copy_whatever_their_labels() -> None:
    # The shared empty labels must not make a request, or a lease holding one,
    # something pickle or copy refuses (a process pool, a deep copy).
    book = LeaseBook()
    for n, labels in enumerate(({}, {"job": "llm"})):
        req = decoded("slurm-eu", request_id=f"r{n}", gpu="L4", gpus=1, labels=labels)
        lease = book.create(req, placement(offer()), lease_seconds=60, cap=None, now=T0)
        for original in (req, lease):
            for again in (pickle.loads(pickle.dumps(original)), copy.deepcopy(original)):
                assert again == original
        if not labels:
            assert pickle.loads(pickle.dumps(req)).labels is NO_LABELS
    assert copy.copy(NO_LABELS) is NO_LABELS
    assert NO_LABELS == {} and not NO_LABELS and repr(NO_LABELS) == "{}"


def test_a_lease_read_back_shares_its_requests_strings_and_equal_times() -> None:
    book = LeaseBook()
    lease = book.create(decoded("slurm-eu", request_id="r1", gpu="L4", gpus=1),
                        placement(offer()), lease_seconds=60, cap=None, now=T0)
    ended = book.end(lease.lease_id, lease.state.RELEASED, T0)
    for stored in (lease, ended):
        row = lease_row(stored, 1)
        read = lease_from(json.loads(row[5]))
        assert read == stored
        assert lease_row(read, 1) == row  # the stored form is unchanged
        assert read.request_id is read.request.request_id
        assert read.scheduler is read.request.scheduler
        assert read.updated_at is read.created_at
    assert read.ended_at is read.updated_at


def test_the_markets_a_choice_serves_are_read_from_one_table() -> None:
    """`markets_for`: paid-for capacity serves spot and on-demand requests too, `any`
    takes every market, `reserved` only itself; anything else is a ValueError, as
    `Market` gives. The table is made of `MARKETS`, every market in the enum's order."""
    import pytest

    from broker.model import MARKETS, Market, markets_for

    assert tuple(Market) == MARKETS
    assert markets_for("any") == frozenset(Market)
    assert markets_for("reserved") == {Market.RESERVED}
    for m in (Market.SPOT, Market.ON_DEMAND):
        assert markets_for(m.value) == {m, Market.RESERVED}
    with pytest.raises(ValueError, match="not a valid Market"):
        markets_for("cheapest")
