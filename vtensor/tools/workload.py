"""What the plan command trains: a model from the zoo or an import path, a random batch, a loss."""

import importlib
import importlib.metadata
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_CLASSES = 10
Batch = tuple[torch.Tensor, torch.Tensor]
Builder = Callable[[], nn.Module]


class UsageError(Exception):
    """A command-line value that cannot be used; the message names it and the fix."""


def load_builder(spec: str, batch_shape: tuple[int, ...], vocab: int | None) -> Builder:
    """A seeded builder of the model named ``spec`` (zoo name or ``package.module:factory``)."""
    make = _import_factory(spec) if ":" in spec else _zoo_factory(spec, batch_shape, vocab)

    def build() -> nn.Module:
        torch.manual_seed(0)
        try:
            model = make()
        except Exception as err:  # the factory is user code: report whatever it raised
            raise UsageError(
                f"MODEL {spec!r} failed to build: {type(err).__name__}: {err}"
            ) from err
        if not isinstance(model, nn.Module):
            raise UsageError(f"MODEL {spec!r} returned {type(model).__name__}, not an nn.Module")
        return model

    return build


def _import_factory(spec: str) -> Callable[[], object]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"MODEL {spec!r} is not of the form package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UsageError(f"MODEL {spec!r}: cannot import {module_name!r}: {err}") from err
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"MODEL {spec!r}: {module_name} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]


ZOO_GROUP = "vtensor.model_zoo"


def _zoo_factory(
    name: str, batch_shape: tuple[int, ...], vocab: int | None
) -> Callable[[], object]:
    """The builder of ``name`` from the first installed zoo (entry points ``vtensor.model_zoo``).

    A zoo is ``(name, batch_shape, vocab) -> builder``, raising ``LookupError`` or ``ValueError``.
    """
    zoos = sorted(importlib.metadata.entry_points(group=ZOO_GROUP), key=lambda e: e.name)
    if not zoos:
        raise UsageError(
            f"MODEL {name!r} is a zoo name but no model zoo is installed (entry point group "
            f"{ZOO_GROUP!r}); install edgefl or give package.module:factory"
        )
    unknown = []
    for zoo in zoos:
        try:
            return zoo.load()(name, batch_shape, vocab)  # type: ignore[no-any-return]
        except LookupError as err:
            unknown.append(str(err))
        except ValueError as err:
            raise UsageError(str(err)) from err
    raise UsageError(f"{'; '.join(unknown)} and not package.module:factory")


def make_batch(
    batch_shape: tuple[int, ...],
    target_shape: tuple[int, ...] | None,
    vocab: int | None,
    device: str | torch.device,
) -> tuple[Batch, int]:
    """A random batch and its number of target classes.

    With a ``vocab``: token ids below it, targets of the inputs' shape; else floats, one target
    class per example.
    """
    gen = torch.Generator().manual_seed(1)
    classes = DEFAULT_CLASSES if vocab is None else vocab
    if vocab is None:
        x = torch.randn(batch_shape, generator=gen)
    else:
        x = torch.randint(0, classes, batch_shape, generator=gen)
    default_targets = batch_shape[:1] if vocab is None else batch_shape
    y = torch.randint(0, classes, target_shape or default_targets, generator=gen)
    return (x.to(device), y.to(device)), classes


def _logits(out: torch.Tensor, y: torch.Tensor, classes: int) -> bool:
    return out.is_floating_point() and out.shape[:-1] == y.shape and out.shape[-1] >= classes


def training_loss(out: torch.Tensor, y: torch.Tensor, classes: int) -> torch.Tensor:
    """Cross-entropy if ``out`` is (targets' shape, >= classes) logits, else mean square."""
    if _logits(out, y, classes):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return out.float().square().mean()


def loss_name(build: Builder, batch: Batch, classes: int) -> str:
    """Which loss ``training_loss`` picks for this model and batch."""
    model = build().to(batch[0].device)
    try:
        with torch.no_grad():
            out = model(batch[0])
    except Exception as err:  # user model on a user shape: report whatever it raised
        first_line = str(err).splitlines()[0] if str(err) else ""
        shape = tuple(batch[0].shape)
        raise UsageError(
            f"the model failed on a batch of shape {shape}: {type(err).__name__}: {first_line}"
        ) from err
    if not isinstance(out, torch.Tensor):
        raise UsageError(f"the model returned {type(out).__name__}; the CLI needs one tensor")
    return "cross-entropy" if _logits(out, batch[1], classes) else "mean square of the output"
