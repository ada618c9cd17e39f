"""A request as it arrives on MQTT (`P/requests/S/<verb>`): the `Command` it carries,
with its reply topic checked, or why it is dropped."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from broker.edges.mqtt import Message
from broker.model import scheduler_id_problem
from broker.output.ratelimit import Every
from broker.wire.commands import Command
from broker.wire.messages import Topics

log = structlog.get_logger("gpubroker.bus")


def command_of(message: Message, topics: Topics, *, v5: bool, dropped: Every,
               done: Callable[[], None] | None) -> Command | None:
    """The command a request message carries; None for one dropped unanswered (a
    retained one on MQTT 3.1.1, a topic that is no request, an invalid or reserved
scheduler id: logged, those at most once per `dropped`)."""
    topic = message.topic
    if message.retain and not v5:
        # MQTT 3.1.1 marks only the replay on subscribe (a persistent session's
        # subscription is not re-made, so that is rare); ignore it.
        log.info("ignored retained request", topic=topic)
        return None
    parsed = topics.parse_request(topic)
    if parsed is None:
        return None
    scheduler, verb = parsed
    if (problem := scheduler_id_problem(scheduler)) is not None:
        if count := dropped.hit():
            log.warning("request from an invalid or reserved scheduler id dropped",
                        topic=topic, problem=problem, dropped=count)
        return None
    reply = None
    response_topic = message.response_topic
    if response_topic:
        # The reply is published with the daemon's rights, so it may only go where
        # the scheduler itself could read: P/replies/S/... Anything else would let
        # one scheduler write into another's events or leases.
        if topics.may_reply(scheduler, response_topic):
            correlation = message.correlation_data or b""
            reply = {"response_topic": response_topic,
                     "correlation_data": correlation.hex()}
        else:
            log.warning("ResponseTopic outside the scheduler's replies tree ignored",
                        scheduler=scheduler, response_topic=response_topic,
                        allowed=topics.replies(scheduler) + "/#")
    # On MQTT 5 a retained request keeps its flag (Retain-As-Published): the broker
    # answers it request.invalid and does not act on it.
    return Command(scheduler, verb, message.payload, topic, reply,
                   retained=bool(message.retain), done=done)
