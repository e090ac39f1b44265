"""Where a model's weights live between requests: its residency.

    resident    loaded onto the device and kept there (the default)
    on_demand   a copy kept in host memory (pinned on CUDA); copied onto the device
                by the first request that needs it (a cold start, counted and timed),
                taken off again when idle for `idle_seconds`, or when the device
                memory budget needs room for another model (least recently used
                first)
    sharded     the encoder's transformer layers split into contiguous runs, one per
                device (every worker's), hidden states moved from one to the next;
                served by the first worker, whose device also holds the embeddings,
                the pooling and the head. Needs at least two devices (two CPU
                workers stand in for two GPUs, through the same code).

The device copy is made with `Tensor.to(device, copy=True)` from the host copy, on
every device: on CUDA that is the host-to-device copy; on the CPU it is a second,
real copy in the process's memory, so taking it off gives memory back there too and
the CPU runs the same code as a GPU. Taking it off puts every parameter and buffer on
the meta device (shapes only), and drops the traced graph, which holds the device
tensors; a cold start traces it again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from capability.bundle import BundleConfigInvalid
from capability.model import SentenceEncoder, TextClassifier

RESIDENT = "resident"
ON_DEMAND = "on_demand"
SHARDED = "sharded"
RESIDENCIES = (RESIDENT, ON_DEMAND, SHARDED)
# How long an on-demand model may go unused before it leaves the device, by default.
DEFAULT_IDLE_SECONDS = 300.0

# Why an on-demand model left the device (`reason` of classify_model_evictions_total).
EVICTED_IDLE = "idle"
EVICTED_FOR_ROOM = "budget"

_META = torch.device("meta")


def _owned_tensors(module: nn.Module) -> Iterator[tuple[nn.Module, str, Tensor, bool]]:
    """(owner, attribute, tensor, is_parameter) for every parameter and buffer, persistent
    or not, shared ones once per owner."""
    for owner in module.modules():
        for name, parameter in owner._parameters.items():
            if parameter is not None:
                yield owner, name, parameter, True
        for name, buffer in owner._buffers.items():
            if buffer is not None:
                yield owner, name, buffer, False


class OnDemandWeights:
    """The host copy of one replica's weights, and putting them on and off its device.
    `restore` and `evict` run on the worker's device thread."""

    def __init__(self, classifier: TextClassifier, graph: str) -> None:
        self._classifier = classifier
        self._graph = graph
        device = classifier.device
        # One host copy per tensor, however many modules share it (tied weights).
        self._host: dict[int, Tensor] = {}
        self._places: list[tuple[nn.Module, str, int, bool]] = []
        for owner, name, tensor, is_parameter in self._every_tensor():
            key = id(tensor)
            if key not in self._host:
                host = tensor.detach().to("cpu", copy=True)
                self._host[key] = host.pin_memory() if device.type == "cuda" else host
            self._places.append((owner, name, key, is_parameter))
        self.resident = True

    def _every_tensor(self) -> Iterator[tuple[nn.Module, str, Tensor, bool]]:
        yield from _owned_tensors(self._classifier.encoder)
        yield from _owned_tensors(self._classifier.head)

    def begin_eviction(self) -> None:
        """On the event loop, as `evict` is handed to the device thread: from now on the
        weights count as off the device, so a request that arrives while they are being
        taken off waits for a cold start instead of being queued behind the eviction
        (its batch would run on meta tensors)."""
        self.resident = False

    def evict(self) -> None:
        """Take the weights off the device: meta tensors in their place, no graph."""
        self._place({key: host.to(_META) for key, host in self._host.items()})
        # The traced graph holds the device tensors; an eager wrapper over meta
        # tensors holds nothing (and is never run: a request restores first).
        self._classifier.use_graph("eager")
        self.resident = False

    def restore(self) -> None:
        """Copy the weights onto the device and trace the graph again."""
        device = self._classifier.device
        self._place(
            {key: host.to(device, non_blocking=True, copy=True) for key, host in self._host.items()}
        )
        self._classifier.use_graph(self._graph)
        self.resident = True

    def _place(self, tensors: Mapping[int, Tensor]) -> None:
        for owner, name, key, is_parameter in self._places:
            tensor = tensors[key]
            if is_parameter:
                owner._parameters[name] = nn.Parameter(tensor, requires_grad=False)
            else:
                owner._buffers[name] = tensor


def layer_runs(layers: int, devices: int) -> list[range]:
    """Contiguous runs of layer indexes, one per device, as even as they can be."""
    base, extra = divmod(layers, devices)
    runs, start = [], 0
    for index in range(devices):
        size = base + (1 if index < extra else 0)
        runs.append(range(start, start + size))
        start += size
    return runs


def shard_layers(classifier: TextClassifier, devices: Sequence[torch.device]) -> list[range]:
    """Move the encoder's layers onto `devices` in contiguous runs (the first run stays
    on the classifier's device with everything else), and move the hidden states with
    them: each run's first layer takes its inputs onto its device, and the stack's
    output comes back to the first device for pooling and the head. The graph must
    be traced again afterwards (the hooks are traced into it). Returns the runs."""
    encoder = classifier.encoder
    if not isinstance(encoder, SentenceEncoder):
        raise BundleConfigInvalid(
            "config.json: a static-embedding model has no layers to shard "
            "(residency: sharded); use resident or on_demand"
        )
    layers = encoder.encoder.layer
    runs = layer_runs(len(layers), len(devices))
    for device, run in zip(devices, runs, strict=True):
        if not run:
            continue
        for index in run:
            layers[index].to(device)
        layers[run.start].register_forward_pre_hook(_inputs_onto(device))
    encoder.encoder.register_forward_hook(_output_onto(classifier.device))
    return runs


def _inputs_onto(
    device: torch.device,
) -> Callable[[nn.Module, tuple[Tensor, ...]], tuple[Tensor, ...]]:
    def move(module: nn.Module, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return tuple(tensor.to(device) for tensor in inputs)  # (B, T, H), (B, 1, 1, T)

    return move


def _output_onto(device: torch.device) -> Callable[[nn.Module, tuple[Tensor, ...], Tensor], Tensor]:
    def move(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        return output.to(device)  # (B, T, H)

    return move
