"""A manager walks a model again only when its scan may be stale (NOTE [scan once])."""

import gc
import weakref
from pathlib import Path

import torch
from test_lean_replay import CHUNK, _peak, _step
from torch import nn

import vtensor
from vtensor.activations.model_state import (
    ModelScan,
    ScanCache,
    device_of,
    on_device_type,
    state_storages,
)
from vtensor.activations.runtime.admission import Admission

CPU = torch.device("cpu")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def test_unchanged_model_is_not_walked_again() -> None:
    model, cache = _model(), ScanCache()
    first = cache.of(model)
    assert cache.of(model) is first
    assert first == ModelScan.of(model)


def test_a_parameter_registered_since_is_scanned_and_protected() -> None:
    model, cache = _model(), ScanCache()
    first = cache.of(model)
    model[3].extra = nn.Parameter(torch.ones(4))
    scan = cache.of(model)
    assert scan is not first
    assert any(p is model[3].extra for p in scan.parameters)
    protected, _ = state_storages(scan, None, (), CPU)
    assert _storage(model[3].extra) in protected


def test_a_replaced_submodule_and_buffer_are_scanned() -> None:
    model, cache = _model(), ScanCache()
    cache.of(model)
    model[2] = nn.Tanh()
    assert cache.of(model).names[id(model[2])] == "2"
    model[1].running_mean = torch.zeros(8)  # an existing buffer assigned, not registered anew
    scan = cache.of(model)
    assert any(b is model[1].running_mean for b in scan.buffers)


def test_a_change_of_shape_or_requires_grad_walks_again() -> None:
    model, cache = _model(), ScanCache()
    first = cache.of(model)
    model[0].weight.requires_grad_(False)
    frozen = cache.of(model)
    assert frozen is not first and frozen.structure != first.structure
    model[0].weight.data = torch.zeros(8, 4)
    assert cache.of(model).structure != frozen.structure


def test_a_replaced_storage_is_protected_without_a_new_walk() -> None:
    model, cache = _model(), ScanCache()
    scan = cache.of(model)
    model[0].weight.data = torch.ones(8, 8)  # same shape: the scan holds
    assert cache.of(model) is scan
    protected, _ = state_storages(scan, None, (), CPU)
    assert _storage(model[0].weight) in protected


def test_another_model_is_walked_and_the_cache_keeps_no_model_alive() -> None:
    cache = ScanCache()
    model = _model()
    cache.of(model)
    other = _model()
    assert cache.of(other).names[id(other)] == "model"
    refs = [weakref.ref(other), *(weakref.ref(p) for p in other.parameters())]
    del other
    gc.collect()
    assert all(ref() is None for ref in refs)  # neither the model nor its parameters


def test_the_device_test_matches_the_device_type() -> None:
    on_cpu = on_device_type(CPU)
    assert on_cpu(torch.ones(2))
    assert not on_cpu(torch.ones(2, device="meta"))
    assert on_device_type(torch.device("meta"))(torch.ones(2, device="meta"))
    admission = Admission(CPU, set(), 0)
    assert admission.storage(torch.ones(2)) is not None
    assert admission.storage(torch.ones(2, device="meta")) is None


def test_the_device_read_from_a_scan_is_the_models() -> None:
    # First parameter, else first buffer, else the CPU: as the model's own parameters say.
    with_params = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 2))
    only_buffers = nn.Module()
    only_buffers.register_buffer("b", torch.zeros(2, dtype=torch.float64))
    for model in (with_params, only_buffers, nn.ReLU()):
        assert device_of(ModelScan.of(model)) == device_of(model) == torch.device("cpu")
    meta = nn.Linear(2, 2, device="meta")
    assert device_of(ModelScan.of(meta)) == device_of(meta) == torch.device("meta")


def test_parameters_replaced_without_a_registration_are_scanned() -> None:
    # With torch.__future__'s overwrite on conversion, ``.to``/``.double`` put new Parameter
    # objects straight into each module's ``_parameters``: no registration hook runs. A stale
    # scan would leave the new storages unprotected (the store could adopt a weight).
    model, scans = _model(), ScanCache()
    first = scans.of(model)
    was = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.double()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(was)
    scan = scans.of(model)
    assert scan is not first
    assert [id(p) for p in scan.parameters] == [id(p) for p in model.parameters()]
    assert [id(b) for b in scan.buffers] == [id(b) for b in model.buffers()]


def test_a_parameter_viewed_in_place_to_another_shape_keeps_the_steps_exact(
    tmp_path: Path,
) -> None:
    # NOTE [scan once]: shapes are compared only when a data pointer moved. A view of a
    # parameter's own data from its start keeps the pointer: the scan holds (the fingerprint is
    # that of the old shape), and the replay, which saves a tensor of another size at the loss,
    # leaves its plan; every step stays bit-identical to the unmanaged one.
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)))
    x = torch.randn(2048, 64)
    budget = int(0.6 * _peak(model, x))
    with vtensor.MemoryManager(budget, chunk_bytes=CHUNK, storage_dir=tmp_path) as mm:
        for step in range(4):
            ref = _step(model, x, None)
            assert all(map(torch.equal, ref, _step(model, x, mm))), f"step {step}"
        assert mm.report().plan_source == "planned"
        scan, last = mm._scans.of(model), model[7][0]
        pointer = last.weight.data_ptr()
        last.weight.data = last.weight.data[:16]
        last.bias.data = last.bias.data[:16]
        assert last.weight.data_ptr() == pointer and mm._scans.of(model) is scan
        for step in range(4):
            ref = _step(model, x, None)
            assert [g.shape for g in ref][-2:] == [torch.Size([16, 64]), torch.Size([16])]
            assert all(map(torch.equal, ref, _step(model, x, mm))), f"after, step {step}"
            assert mm.report().peak_device_bytes <= budget + CHUNK
