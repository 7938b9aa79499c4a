"""One exception root: every exception class the package defines derives from SpotError."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import spot_callbacks
from spot_callbacks import SpotError

OPTIONAL = ("lightning", "pytorch_lightning", "hf", "cli")  # import their frameworks; all installed in dev


def package_modules() -> list[str]:
    return [info.name for info in pkgutil.walk_packages(spot_callbacks.__path__, "spot_callbacks.")]


def test_every_exception_class_of_the_package_derives_from_spot_error():
    strays = []
    for name in package_modules():
        if name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__.startswith("spot_callbacks")
                and not issubclass(value, SpotError)
            ):
                strays.append(f"{value.__module__}.{value.__qualname__}")
    assert sorted(set(strays)) == []


@pytest.mark.parametrize(
    ("name", "builtin"),
    [("ConfigError", ValueError), ("CheckpointNotFoundError", FileNotFoundError),
     ("AttemptTimeoutError", TimeoutError), ("PersistError", RuntimeError), ("LockLostError", RuntimeError)],
)  # fmt: skip
def test_the_classes_keep_the_builtin_bases_callers_catch(name, builtin):
    cls = getattr(spot_callbacks, name)
    assert issubclass(cls, SpotError) and issubclass(cls, builtin)
