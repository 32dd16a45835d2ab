"""edgefl's model zoo for ``python -m vtensor plan NAME``: a model built for a random batch's shape.

vtensor knows nothing of edgefl; it finds this function through the ``vtensor.model_zoo``
entry point in pyproject.toml.
"""

from collections.abc import Callable

from torch import nn

from edgefl.data.arrays import DataKind, DatasetInfo
from edgefl.errors import EdgeFLError
from edgefl.models.registry import MODEL_NAMES, build_model

DEFAULT_CLASSES = 10
_KINDS = {4: DataKind.IMAGE, 3: DataKind.SENSOR, 2: DataKind.TOKENS}


def zoo_factory(
    name: str, batch_shape: tuple[int, ...], vocab: int | None
) -> Callable[[], nn.Module]:
    """A builder of zoo model ``name`` for batches of ``batch_shape`` (tokens: ``vocab``).

    Raises:
        LookupError: ``name`` is not in the zoo (the message lists the zoo).
        ValueError: the shape fits no zoo data, or the model cannot be built for it.
    """
    if name not in MODEL_NAMES:
        raise LookupError(f"MODEL {name!r} is not in the zoo ({', '.join(MODEL_NAMES)})")
    kind = DataKind.TOKENS if vocab is not None else _KINDS.get(len(batch_shape))
    if kind is None or (kind is DataKind.TOKENS and vocab is None):
        raise ValueError(
            f"--batch-shape {batch_shape} fits no zoo data: use N,C,H,W (image), "
            "N,C,L (sensor) or N,T with --input-dtype long --vocab V (tokens)"
        )
    classes = vocab if vocab is not None else DEFAULT_CLASSES
    info = DatasetInfo(f"random{batch_shape}", kind, batch_shape[1:], classes)
    try:
        build_model(name, info)  # fail here, as a usage error, not in the middle of a run
    except EdgeFLError as err:
        raise ValueError(str(err)) from err
    return lambda: build_model(name, info)
