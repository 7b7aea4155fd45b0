"""The NATS permission table: who may publish what, read as NATS would match it.

The same questions against a real nats-server are in tests/test_security.py (refusals) and
stack/tests/test_nats_auth.py (each service's real bus operations allowed).
"""

from __future__ import annotations

import pytest

from harnessrl.shared import control_api, subjects
from harnessrl.shared.bus.memory import subject_matches
from harnessrl.shared.nats_permissions import (
    ADMIN,
    CONTROLLER,
    GATEWAY,
    PERMISSIONS,
    REWARD,
    SERVICES,
    TRAINER,
    USERS,
    inbox,
)

RUN, EPISODE = "r1", "e0000-000-00-a0"


def publishers(subject: str) -> set[str]:
    """The services (not the operator) whose grants cover publishing `subject`."""
    return {user for user in SERVICES if any(subject_matches(g, subject) for g in PERMISSIONS[user].publish)}


def subscribers(subject: str) -> set[str]:
    return {
        user for user in SERVICES if any(subject_matches(g, subject) for g in PERMISSIONS[user].subscribe)
    }


def test_every_user_has_permissions_and_only_the_operator_has_everything() -> None:
    assert set(PERMISSIONS) == set(USERS)
    assert PERMISSIONS[ADMIN].publish == (">",)
    for user in SERVICES:
        grants = PERMISSIONS[user].publish + PERMISSIONS[user].subscribe
        assert ">" not in grants and "*" not in grants and "$JS.API.>" not in grants


@pytest.mark.parametrize(
    ("subject", "only"),
    [
        (subjects.episode_event(RUN, EPISODE, "scored"), {REWARD}),
        (subjects.episode_event(RUN, EPISODE, "failed"), {REWARD, CONTROLLER}),
        (subjects.episode_event(RUN, EPISODE, "scheduled"), {CONTROLLER}),
        (subjects.episode_event(RUN, EPISODE, "completed"), {CONTROLLER}),
        (subjects.rollout(RUN), {CONTROLLER}),
        (subjects.run_event(RUN, "stopped"), {CONTROLLER}),
        (subjects.span(RUN, EPISODE), {GATEWAY}),
        (subjects.weights(RUN), {TRAINER}),
        (subjects.upstreams(), {TRAINER}),
        (subjects.metrics(RUN, "trainer"), {TRAINER}),
        (control_api.subject("submit"), set()),
        (control_api.subject("open"), set()),
        (f"$KV.{subjects.EPISODE_STATE.name}.run-x", {CONTROLLER}),
        (f"$KV.{subjects.REWARD_RESULTS.name}.ep-x", {REWARD}),
        (f"$JS.API.STREAM.UPDATE.{subjects.EPISODES.name}", {CONTROLLER}),
        (f"$JS.API.STREAM.DELETE.{subjects.EPISODES.name}", set()),
    ],
)
def test_who_may_publish(subject: str, only: set[str]) -> None:
    assert publishers(subject) == only


def test_each_service_reads_only_its_own_inbox() -> None:
    for user in SERVICES:
        assert f"{inbox(user)}.>" in PERMISSIONS[user].subscribe
        for other in USERS:
            if other != user:
                assert not any(subject_matches(g, f"{inbox(other)}.x") for g in PERMISSIONS[user].subscribe)
    assert subscribers(control_api.subject("submit")) == {CONTROLLER}
    assert [user for user in USERS if PERMISSIONS[user].allow_responses] == [CONTROLLER, ADMIN]


def test_grants_are_valid_subject_patterns() -> None:
    for user in USERS:
        for grant in PERMISSIONS[user].publish + PERMISSIONS[user].subscribe:
            tokens = grant.split(".")
            assert all(tokens) and " " not in grant, grant
            assert ">" not in tokens[:-1], grant
