import pytest

from qvl import settings, tiny
from qvl.engine import Engine


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tiny.build(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def engine(tiny_dir):
    return Engine(settings.parse(["--model", str(tiny_dir), "--quant", "fp32", "--no-cache"], env={}))
