"""`iwg serve` at zero replicas without a model (zero_pool.py): the local scaler starts a replica's workers for
the first held request, stops them after scaleToZeroAfterSeconds idle, and starts them again for the next
request. In process: the driver's own app, the fake replica pool as the started workers."""

from __future__ import annotations

import asyncio
import time

import pytest
from iwg_worker.driver.zero_pool import LocalScaler, ZeroPool, scaling

from tests.iwg_operator.test_autoscaling_policy import spec
from tests.iwg_worker.driver.fakes import FakePool
from tests.iwg_worker.driver.test_driver_activation import until
from tests.iwg_worker.driver.test_driver_routing import embed, metric, serve

pytestmark = pytest.mark.timeout(60)


class Workers(FakePool):
    """One replica's workers as a fresh executor would hold them; `close` stops them."""

    def __init__(self) -> None:
        super().__init__(replicas=1)
        self.stopped = False

    async def close(self) -> None:
        self.stopped = True


async def test_a_local_group_at_zero_starts_a_replica_per_activation_and_stops_it_when_idle() -> None:
    started: list[Workers] = []

    def start() -> Workers:  # runs in a thread, as the executor's blocking start does
        time.sleep(0.2)
        started.append(Workers())
        return started[-1]

    zero = ZeroPool()
    # 3 s idle before the stop: the checks right after each answer find the replica still up on a stalled machine.
    idle = spec(min_replicas=0, max_replicas=1, scale_to_zero_after_seconds=3)
    async with serve(zero, activation_timeout_s=30.0) as (client, driver):
        scaler = LocalScaler(driver, zero, start, idle, drain_timeout_s=5.0, pool_of=lambda workers: workers)
        async with scaling(scaler):
            assert driver.ready and zero.states() == {}  # it holds requests, and runs no worker yet
            for activation in range(2):
                status, body, _ = await asyncio.wait_for(embed(client, f"text {activation}"), 30)
                assert status == 200 and body["data"][0]["embedding"] == [6.0, 0.0]
                assert len(started) == activation + 1 and not started[-1].stopped
                await asyncio.wait_for(until(lambda: not zero.running), 30)  # idle 3 s: drained, stopped
                assert started[-1].stopped and zero.states() == {} and driver.router.serving() == []
    assert metric(driver, "iwg_activation_seconds_count") == 2
    assert 0.2 <= metric(driver, "iwg_last_activation_seconds") < 5
