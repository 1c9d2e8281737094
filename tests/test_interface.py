"""The serving side asks every engine the same things, written once as conversation.Engine: the model loaded here and a
remote server alike implement all of it, with the same parameters."""
import inspect

import pytest

from qvl import conversation, settings
from qvl.engine.remote import RemoteEngine

METHODS = [name for name, member in vars(conversation.Engine).items()
           if inspect.isfunction(member) and not name.startswith("_")]


def test_the_interface_names_what_the_serving_side_uses():
    assert {"chat", "warm_up", "progress", "set_threads", "memory_info", "forget", "close"} <= set(METHODS)
    assert {"model_id", "identity", "precision", "threads", "fallback", "ready"} <= set(
        conversation.Engine.__annotations__)


@pytest.fixture(params=["local", "remote"])
def either(request, engine):
    if request.param == "local":
        yield engine
        return
    remote = RemoteEngine(settings.parse(["--backend", "http://127.0.0.1:9/v1"], env={}))
    yield remote
    remote.close()


def test_each_engine_implements_every_member_with_the_same_parameters(either):
    assert isinstance(either, conversation.Engine)
    for name in METHODS:
        wanted = list(inspect.signature(getattr(conversation.Engine, name)).parameters)[1:]  # without self
        assert list(inspect.signature(getattr(either, name)).parameters) == wanted, name

