"""WorkerWrapperBase: lazy init, class resolution, extension as a built subclass, forwarding, dispatch."""

from __future__ import annotations

import os

import pytest
from iwg_worker.method_registry import UnknownMethodError
from iwg_worker.torch_worker import TorchWorker
from iwg_worker.worker_base import WorkerConfig
from iwg_worker.worker_wrapper import WorkerWrapperBase

EXT = "tests.iwg_worker.extensions.ProbeExtension"


def _wrapper(extension: str | None = EXT) -> WorkerWrapperBase:
    wrapper = WorkerWrapperBase(rpc_rank=1)
    wrapper.init_worker(
        [
            {},
            {
                "worker_cls": "iwg_worker.torch_worker.TorchWorker",
                "worker_extension_cls": extension,
                "config": WorkerConfig(device="cpu"),
            },
        ]
    )
    wrapper.require_worker().init_device()
    return wrapper


def test_phase_one_records_the_rank_only() -> None:
    wrapper = WorkerWrapperBase(rpc_rank=3)
    assert wrapper.rpc_rank == 3 and wrapper.worker is None
    with pytest.raises(AttributeError, match="not initialised"):
        wrapper.check_health  # noqa: B018


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("iwg_worker.torch_worker.NoSuchWorker", "has no 'NoSuchWorker'"),
        ("no_such_package.Worker", "cannot import 'no_such_package'"),
        ("Worker", "not a qualified name"),
        ("iwg_worker.torch_worker.host_memory_info", "not a class"),
    ],
)
def test_unresolvable_worker_cls_names_the_string(name: str, fragment: str) -> None:
    wrapper = WorkerWrapperBase()
    with pytest.raises(ValueError, match="worker_cls") as info:
        wrapper.init_worker([{"worker_cls": name, "config": WorkerConfig()}])
    assert repr(name) in str(info.value) and fragment in str(info.value)


def test_extension_is_a_built_subclass_and_leaves_classes_untouched() -> None:
    from tests.iwg_worker.extensions import ProbeExtension

    bases_before = (TorchWorker.__bases__, ProbeExtension.__bases__)
    wrapper = _wrapper()
    worker = wrapper.require_worker()
    assert type(worker) is not TorchWorker
    assert isinstance(worker, TorchWorker) and isinstance(worker, ProbeExtension)
    assert (TorchWorker.__bases__, ProbeExtension.__bases__) == bases_before
    assert not hasattr(TorchWorker, "env_value")
    # A plain worker built afterwards has no extension members.
    assert not hasattr(_wrapper(extension=None).require_worker(), "env_value")


def test_extension_member_clash_is_an_error() -> None:
    with pytest.raises(TypeError, match=r"ClashingExtension defines \['check_health'\]"):
        _wrapper("tests.iwg_worker.extensions.ClashingExtension")


def test_forwarding_caches_bound_methods_on_the_wrapper() -> None:
    wrapper = _wrapper()
    assert "describe" not in vars(wrapper)
    first = wrapper.describe
    assert vars(wrapper)["describe"] is first  # next lookups are plain attribute hits
    assert wrapper.describe() == wrapper.require_worker().describe()  # type: ignore[attr-defined]
    # Re-initialising drops the cached methods of the old worker.
    wrapper.init_worker([{}, {"worker_cls": "iwg_worker.torch_worker.TorchWorker", "config": WorkerConfig()}])
    assert "describe" not in vars(wrapper)


def test_update_environment_variables_picks_this_ranks_mapping() -> None:
    wrapper = _wrapper()
    wrapper.update_environment_variables([{"IWG_TEST_VAR": "zero"}, {"IWG_TEST_VAR": "one"}])
    try:
        assert wrapper.execute_method("env_value", ["IWG_TEST_VAR"], {}) == "one"
    finally:
        os.environ.pop("IWG_TEST_VAR", None)


def test_dispatch_by_name_and_timings() -> None:
    wrapper = _wrapper()
    assert wrapper.execute_method("echo", [1, "a"], {}) == [1, "a"]
    assert wrapper.execute_method("get_free_memory_mb", [], {}) > 0
    with pytest.raises(ValueError, match="seconds"):
        wrapper.execute_method("sleep", [61], {})
    for name in ("no_such_method", "_require_device", "__class__", "config"):
        with pytest.raises(UnknownMethodError, match=repr(name)):
            wrapper.execute_method(name, [], {})
    timings = wrapper.timings.snapshot()
    assert timings["echo"]["count"] == 1 and timings["sleep"] == {**timings["sleep"], "count": 1, "errors": 1}


def test_test_helpers_and_removed_methods_are_not_served_by_a_production_worker() -> None:
    # echo and sleep come from the tests' ProbeExtension only; adjust_batch_params and put_mm_features are
    # gone (batching is the driver's; nothing sent features).
    wrapper = WorkerWrapperBase(rpc_rank=0)
    wrapper.init_worker([{"worker_cls": "iwg_worker.torch_worker.TorchWorker", "config": WorkerConfig()}])
    for name in ("echo", "sleep", "adjust_batch_params", "put_mm_features"):
        with pytest.raises(UnknownMethodError, match=repr(name)):
            wrapper.execute_method(name, [], {})
