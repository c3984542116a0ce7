"""Devices the controller and the timer act on, with injected devices, collectives and events
(the machines here have no GPU, the GPU test machine one: several devices are tested only so)."""

from types import SimpleNamespace

import pytest
import torch
from support import checkpointed_lm

from tapesac_core import TapeSACError
from tapesac_core.control.controller import Controller
from tapesac_core.measure.memory import AcceleratorMeter
from tapesac_core.measure.timing import DeviceQueue, NodeTimer, seconds

CUDA1 = torch.device("cuda", 1)


@pytest.fixture
def nccl_on_two_ranks(monkeypatch):
    """torch.distributed as two NCCL ranks whose current CUDA device is 0; records collectives."""
    calls = []
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: calls.append(("all_reduce",)))
    monkeypatch.setattr(
        dist,
        "broadcast_object_list",
        lambda objects, **kw: calls.append(("broadcast", kw.get("device"))),
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    real_tensor = torch.tensor

    def tensor(data, *, device=None, **kwargs):  # no CUDA here: the device asked for is kept
        calls.append(("tensor", torch.device(device)))
        return real_tensor(data, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    return calls


def test_collectives_take_tensors_on_the_controllers_device(nccl_on_two_ranks) -> None:
    c = Controller(checkpointed_lm(num_layers=2), 0.5, device=CUDA1)
    assert c.ranks.largest([3, 5]) == [3, 5]

    def fail():
        raise RuntimeError("no plan")

    with pytest.raises(TapeSACError, match="no plan"):  # rank 0 tells the others, then raises
        c.ranks.plan_of_rank_0(fail, c.model_key)
    assert nccl_on_two_ranks == [("tensor", CUDA1), ("all_reduce",), ("broadcast", CUDA1)]


class _Event:
    """Stands in for ``torch.Event``: remembers its device and the stream it was recorded on."""

    recorded: list = []

    def __init__(self, device, enable_timing) -> None:
        self.device = device

    def record(self, stream=None) -> None:
        _Event.recorded.append((self.device, stream))


def test_node_timer_records_events_on_the_stream_of_the_device_it_times(monkeypatch) -> None:
    streams = {CUDA1: "stream of cuda:1", torch.device("cuda", 0): "stream of cuda:0"}
    monkeypatch.setattr(torch, "Event", _Event)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: streams[device])
    _Event.recorded = []
    timer = NodeTimer(CUDA1, queue=DeviceQueue(lambda seconds: None))
    timer.stop(timer.start())
    assert _Event.recorded == [(CUDA1, "stream of cuda:1")] * 2


def test_with_fsdp2_cpu_offload_the_controller_meters_the_compute_device() -> None:
    model = checkpointed_lm(num_layers=2)
    # FSDP2 with CPUOffloadPolicy: parameters stay on the CPU, blocks compute on cuda:1.
    model.layers[0]._get_fsdp_state = lambda: SimpleNamespace(_device=CUDA1)
    c = Controller(model, 0.5)
    assert next(model.parameters()).device.type == "cpu"
    assert c.device == CUDA1
    meter = c._meter()
    assert isinstance(meter, AcceleratorMeter) and meter.device == CUDA1
    # An explicit device wins; a model FSDP2 does not shard keeps its parameters' device.
    assert Controller(model, 0.5, device="cuda:0").device == torch.device("cuda", 0)
    assert Controller(checkpointed_lm(num_layers=2), 0.5).device == torch.device("cpu")


class SimulatedDevice:
    """One device queue, in microseconds: work starts once the host enqueued it and the device
    finished what was queued before; an event's time is when the device reaches it."""

    def __init__(self) -> None:
        self.host = 0.0  # host clock
        self.free_at = 0.0  # the device finishes its queue

    def enqueue(self, duration: float) -> None:
        self.free_at = max(self.free_at, self.host) + duration

    def launch(self, host_cost: float, device_cost: float) -> None:
        """The host spends ``host_cost`` dispatching an op that runs ``device_cost`` on the device."""
        self.host += host_cost
        self.enqueue(device_cost)

    def event(self, device, enable_timing):
        sim = self

        class Event:
            def record(self, stream=None) -> None:
                self.at = max(sim.free_at, sim.host)

            def synchronize(self) -> None:
                pass

            def elapsed_time(self, end) -> float:
                return (end.at - self.at) / 1e3  # milliseconds, as torch.Event's

        return Event()


def test_event_timed_node_times_are_the_ops_device_time_not_the_hosts_dispatch_gap(
    monkeypatch,
) -> None:
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: None)
    sim = SimulatedDevice()
    delays = []

    def delay(s):
        delays.append(sim.host)
        sim.enqueue(s * 1e6)

    queue = DeviceQueue(delay, clock=lambda: sim.host / 1e6)
    timer = NodeTimer(CUDA1, queue=queue, event=sim.event)
    samples = []
    for _ in range(600):  # cheap ops: 3 us on the device, 20 us of host dispatch each
        start = timer.start()
        sim.launch(20.0, 3.0)
        samples.append(timer.stop(start))
    assert {seconds(s) for s in samples} == {3.0 / 1e3 / 1e3}
    # Sleeps were queued when the host came within 1 ms of the end of the queued 5 ms ones.
    assert delays == [0.0, 4020.0, 9020.0]
