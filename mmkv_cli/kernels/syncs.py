"""Counting the calls that would make the host wait for a GPU, on a CPU run.

On a GPU, `tensor.item()`, a tensor's truth value, `.tolist()`, `.cpu()`, `nonzero`, a boolean
mask (whose result size only the device knows), and a copy between host and device without
`non_blocking` (PyTorch waits for the stream after copying pageable memory) each stop the host
until every queued kernel has run: a hot loop with one per layer runs at the speed of the round
trips, not of the GPU. The CPU shows none of that, so the tests count those calls with a
TorchFunctionMode.

Only tensors that would live on the model's device count. A CPU run cannot tell them apart by
their device, so the counter follows where each tensor comes from: the model's parameters and
buffers are on the device, and so is what an op makes from a tensor there; `.cpu()` and `.to("cpu")`
move to the host. A torch.device is the model's when it was read off a tensor on the device
(`keys.device`) or handed to `on_device` (`backbone.device`): moving or making a tensor there puts
it on the device. What is made on the host (`torch.arange(n)`, the layout's positions) is host
bookkeeping, and reading it costs nothing.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

from mmkv_cli.core.lazy import torch

# Tensor methods and functions whose result the host must wait for (a value, or a size only the
# device knows)
SYNCING = frozenset(
    {
        "item",
        "tolist",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__array__",
        "numpy",
        "cpu",
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "unique_consecutive",
        "bincount",
    }
)
# torch functions that make a tensor from host data (a copy to the device when one is named)
FROM_HOST_DATA = frozenset({"tensor", "as_tensor", "from_numpy"})


class SyncCounter:
    """Counts, by name, the calls that would sync a GPU while `counting(model)` is on."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._device = torch.utils.weak.WeakIdKeyDictionary()  # tensors on the device
        self._handles: dict[int, object] = {}  # torch.device objects naming the device

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def on_device(self, *things) -> None:
        """Mark tensors as on the device, and torch.device objects as naming it."""
        for thing in things:
            if isinstance(thing, torch.Tensor):
                self._device[thing] = True
            else:
                self._handles[id(thing)] = thing

    def _marked(self, value) -> bool:
        return isinstance(value, torch.Tensor) and value in self._device

    def _side(self, target) -> bool | None:
        """Where `.to(target)` / `device=target` lands: True the device, False the host, None
        neither said (a dtype)."""
        if isinstance(target, torch.Tensor):
            return self._marked(target)
        if isinstance(target, str):
            return target != "cpu"  # "cpu" by name is the host; "cuda" the device
        if isinstance(target, torch.device):
            return id(target) in self._handles or target.type != "cpu"
        return None

    def _target(self, name: str, args: tuple, kwargs: dict):
        if "device" in kwargs:
            return kwargs["device"]
        if name == "to" and len(args) > 1 and not isinstance(args[1], torch.dtype):
            return args[1]
        return None

    def _count(self, name: str, args: tuple, kwargs: dict, moves_to: bool | None) -> None:
        first = args[0] if args else None
        waits = not kwargs.get("non_blocking", False)
        if name in SYNCING:
            hit = self._marked(first)
        elif name in ("__getitem__", "__setitem__") and len(args) > 1:
            hit = self._indexing_waits(name, args, waits)
        elif name == "where":  # the one-argument form is nonzero
            hit = len(args) + len(kwargs) == 1 and self._marked(first)
        elif name == "to" and moves_to is not None:  # a copy across, waited for
            hit = waits and moves_to != self._marked(first)
        elif name == "copy_" and len(args) > 1:
            hit = waits and self._marked(first) != self._marked(args[1])
        elif name in FROM_HOST_DATA:  # nothing to copy from an empty list
            empty = isinstance(first, list | tuple) and not first
            hit = moves_to is True and not empty and not self._marked(first)
        else:
            hit = False
        if hit:
            self.calls[name] += 1

    def _indexing_waits(self, name: str, args: tuple, waits: bool) -> bool:
        """`t[index]` / `t[index] = value`: a boolean mask's size only the device knows; an index
        tensor on the other side of `t` is copied across first, and waited for; so is a plain
        number put through an index tensor into `t` on the device (as a one-value tensor)."""
        first, index = args[0], args[1] if isinstance(args[1], tuple) else (args[1],)
        tensors = [i for i in index if isinstance(i, torch.Tensor)]
        masks = [i for i in tensors if i.dtype == torch.bool]
        if masks and any(self._marked(t) for t in (first, *masks)):
            return True
        gathers = [i for i in tensors if i.dtype != torch.bool and i.dim() > 0]
        if any(self._marked(i) != self._marked(first) for i in gathers):
            return True
        if name != "__setitem__":
            return False
        value = args[-1]
        if isinstance(value, torch.Tensor):  # a copy across
            return waits and self._marked(value) != self._marked(first)
        return bool(gathers) and self._marked(first) and isinstance(value, bool | int | float)

    @contextmanager
    def counting(self, model=None):
        """Count while on; `model`: its parameters and buffers are on the device."""
        from torch.overrides import TorchFunctionMode
        from torch.utils._pytree import tree_flatten

        if model is not None:
            self.on_device(*model.parameters(), *model.buffers())
        counter = self
        device_property = torch._C.TensorBase.__dict__["device"]

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if getattr(func, "__self__", None) is device_property:  # tensor.device
                    if counter._marked(args[0]):
                        counter.on_device(out)
                    return out
                name = getattr(func, "__name__", "")
                moves_to = (
                    False if name == "cpu" else counter._side(counter._target(name, args, kwargs))
                )
                counter._count(name, args, kwargs, moves_to)
                if moves_to is None:
                    inputs = tree_flatten((args, kwargs))[0]
                    moves_to = any(counter._marked(v) for v in inputs)
                moved = name in ("to", "cpu") and isinstance(out, torch.Tensor)
                if moved and counter._marked(out) != bool(moves_to):
                    out = out.view(out.shape)  # the CPU hands back the tensor itself; a GPU a copy
                if moves_to:
                    for value in tree_flatten(out)[0]:
                        if isinstance(value, torch.Tensor):
                            counter._device[value] = True
                return out

        with Mode():
            yield self
