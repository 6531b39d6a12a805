"""Every world's environment and checker conforms to the library's protocols
(opd.environments.Environment, opd.checker): mypy checks the annotated assignments below
(pyproject.toml lists this file), the tests check the same at run time."""

from __future__ import annotations

import importlib.util

import pytest
from env_fixtures import BrokenConstructor, Counter, FailingPreload, HangingConstructor, Preloaded

from opd.checker import AnswerChecker, EpisodeChecker, takes_state
from opd.environments import Environment, check_environment
from worlds.toolcalc.tasks import check_answer

# Checked by mypy: a world whose methods or signatures drift from the protocol fails `mypy`.
TOOLCALC_CHECKER: AnswerChecker = check_answer
TEST_ENVIRONMENTS: tuple[type[Environment], ...] = (
    Counter, BrokenConstructor, HangingConstructor, Preloaded, FailingPreload)

HAS_BFCL = importlib.util.find_spec("bfcl_eval") is not None
if HAS_BFCL:
    from worlds.bfcl.checker import check as bfcl_check
    from worlds.bfcl.environment import BFCLEnvironment

    BFCL_CHECKER: EpisodeChecker = bfcl_check
    BFCL_ENVIRONMENT: type[Environment] = BFCLEnvironment


@pytest.mark.parametrize("environment", TEST_ENVIRONMENTS, ids=lambda cls: cls.__name__)
def test_test_environments_conform(environment):
    assert issubclass(environment, Environment)
    check_environment(environment)


def test_an_environment_without_state_is_refused():
    class NoState:
        def call(self, name, arguments):
            return None

    assert not issubclass(NoState, Environment)


def test_toolcalc_checker_takes_the_answer_only():
    assert not takes_state(check_answer)


@pytest.mark.skipif(not HAS_BFCL, reason="the BFCL extra: pip install --no-deps -r "
                                          "requirements-bfcl.txt")
def test_bfcl_world_conforms():
    assert issubclass(BFCLEnvironment, Environment)
    check_environment(BFCLEnvironment)
    assert takes_state(bfcl_check)
