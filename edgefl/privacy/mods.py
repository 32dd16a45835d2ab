"""Client-side privacy: the Flower mods each handler needs, and the keys they add to messages.

NOTE [equal weights]: central DP calibrates its noise to an unweighted mean (one client moves it
by at most clipping_norm / num_sampled_clients), and Flower's accountant refuses replies with
unequal weights. FedAvg weights by a metric key of every train and evaluate reply, so in central
modes the clients add ``UNIT_WEIGHT_KEY = 1`` to their replies and edgefl.privacy.strategy points
FedAvg's ``weighted_by_key`` at it. (Weighting by num-examples would give a large client more
than its share of the mean, past what the noise covers.)
"""

from collections.abc import Callable

from flwr.app import Context, Error, Message
from flwr.clientapp.mod import LocalDpMod, adaptiveclipping_mod, fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM, KEY_NORM_BIT

from edgefl.privacy.settings import ClippingSide, PrivacyMode, PrivacySettings

CLIPPING_NORM_KEY: str = KEY_CLIPPING_NORM  # train config key the client-side DP wrappers send
NORM_BIT_KEY: str = KEY_NORM_BIT  # train metric adaptiveclipping_mod adds: 1 if it clipped
UNIT_WEIGHT_KEY = "dp-unit-weight"  # train/evaluate metric of central modes (NOTE [equal weights])
ERROR_CODE_NO_METRICS = 4101  # Error.code of a reply unit_weight_mod cannot weight


def unit_weight_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Add ``UNIT_WEIGHT_KEY = 1`` to the reply's one MetricRecord (NOTE [equal weights])."""
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    records = list(reply.content.metric_records.values())
    if len(records) != 1:
        reason = f"unit_weight_mod needs exactly one MetricRecord in a reply, found {len(records)}"
        return Message(Error(code=ERROR_CODE_NO_METRICS, reason=reason), reply_to=msg)
    records[0][UNIT_WEIGHT_KEY] = 1
    return reply


def client_train_mods(privacy: PrivacySettings) -> list[Mod]:
    """Mods for the train handler only (``@app.train(mods=...)``), outermost first.

    The clipping mod and LocalDpMod come first so that they act last on the reply, after
    anything else has changed it; a secure-aggregation mod must come before all of them, so
    that it masks the update they clipped and noised.
    """
    if privacy.mode is PrivacyMode.NONE:
        return []
    if privacy.mode is PrivacyMode.LOCAL:
        # Its noise stdev is edgefl.privacy.accounting.local_noise_stdev(privacy).
        local_dp = LocalDpMod(
            clipping_norm=privacy.clipping_norm,
            sensitivity=privacy.local_sensitivity,
            epsilon=privacy.local_epsilon,
            delta=privacy.delta,
        )
        return [local_dp]
    if privacy.clipping_side is ClippingSide.SERVER:
        return [unit_weight_mod]
    if privacy.mode is PrivacyMode.CENTRAL_FIXED:
        return [fixedclipping_mod, unit_weight_mod]
    return [adaptiveclipping_mod, unit_weight_mod]


def client_evaluate_mods(privacy: PrivacySettings) -> list[Mod]:
    """Mods for the evaluate handler (``@app.evaluate(mods=...)``): the unit weight if central.

    Flower's DP mods must not go here: they fail on evaluate messages, which carry no update.
    """
    return [unit_weight_mod] if privacy.central else []


def train_privacy_mod(resolve: Callable[[Context], PrivacySettings]) -> Mod:
    """One mod applying ``client_train_mods(resolve(context))`` to each train message.

    For a ClientApp built before its settings are known (``flwr run`` reads them from the run
    config in the Context), where the mods cannot be listed at ``@app.train`` time.
    """
    return _per_message(lambda context: client_train_mods(resolve(context)))


def evaluate_privacy_mod(resolve: Callable[[Context], PrivacySettings]) -> Mod:
    """One mod applying ``client_evaluate_mods(resolve(context))`` to each evaluate message."""
    return _per_message(lambda context: client_evaluate_mods(resolve(context)))


def _per_message(mods_for: Callable[[Context], list[Mod]]) -> Mod:
    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        call = call_next
        for inner in reversed(mods_for(context)):  # the first mod ends up outermost
            call = _behind(inner, call)
        return call(msg, context)

    return mod


def _behind(mod: Mod, call_next: ClientAppCallable) -> ClientAppCallable:
    return lambda msg, context: mod(msg, context, call_next)


def train_config_keys(privacy: PrivacySettings) -> frozenset[str]:
    """Keys the privacy wrappers add to a train instruction's ConfigRecord."""
    client_side = privacy.central and privacy.clipping_side is ClippingSide.CLIENT
    return frozenset({CLIPPING_NORM_KEY}) if client_side else frozenset()


def train_metric_keys(privacy: PrivacySettings) -> tuple[str, ...]:
    """Keys the privacy mods add to a train reply's MetricRecord, in the order they add them."""
    if not privacy.central:
        return ()
    adaptive_client = (
        privacy.mode is PrivacyMode.CENTRAL_ADAPTIVE
        and privacy.clipping_side is ClippingSide.CLIENT
    )
    return (UNIT_WEIGHT_KEY, NORM_BIT_KEY) if adaptive_client else (UNIT_WEIGHT_KEY,)


def evaluate_metric_keys(privacy: PrivacySettings) -> tuple[str, ...]:
    """Keys the privacy mods add to an evaluate reply's MetricRecord."""
    return (UNIT_WEIGHT_KEY,) if privacy.central else ()
