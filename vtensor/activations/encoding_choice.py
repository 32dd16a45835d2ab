"""Whether an iteration's clamps save bits: always, never, or as the plans decide.

NOTE [encoding decided]
Encoding the clamps' inputs (NOTE [mask encoding] in ``activations/encodings.py``) costs passes
over each input on the compute thread: where nothing has to leave memory it is pure cost, and
where swapping the bytes overlaps on another core it can cost more than it saves
(benchmarks/README.md, ``mask_encoding`` and ``activation_swap``). With
``encode_masks="auto"`` a signature is profiled without the encoding first. If that plan moves
nothing, it is kept and nothing is ever encoded. Otherwise (it moves bytes, or no plan fits)
the next iteration is profiled again with the clamps encoded, its candidates are made as
usual (its trials of recomputation encode too), and the plan without encoding joins them in
the race (NOTE [plan race]): the faster replay is kept. Each plan records whether it was made
encoded (``Plan.encoded``), and its replays, cached or not, encode exactly then. A model without
clamps is profiled once; without planning (the reactive policy) ``"auto"`` encodes. The step
between the two profiles is not left beside the cache: a manager closed in between profiles
without the encoding again.
"""

from vtensor.activations.iteration_plan import IterationPlan
from vtensor.activations.margin import Profile
from vtensor.activations.report import PlanSource
from vtensor.planner.plan import Plan


class EncodingChoice:
    """The ``encode_masks`` setting, and the plans profiled without encoding awaiting the other."""

    def __init__(self, setting: bool | str) -> None:
        self.setting = setting
        self.unencoded: dict[str, tuple[Plan | None, Profile]] = {}

    def apply(self, chosen: IterationPlan, maskable: bool) -> None:
        """Set whether ``chosen`` encodes, and whether its profile may be made again encoded."""
        if chosen.executor is not None:
            chosen.encode = chosen.executor.plan.encoded
        elif not chosen.recompute:  # a trial encodes as its profile did
            auto = self.setting == "auto" and chosen.source is PlanSource.PROFILED
            first = auto and chosen.signature not in self.unencoded
            chosen.encode = bool(self.setting) and not first
            chosen.may_encode = first and maskable

    def defer(self, chosen: IterationPlan, plan: Plan | None, profile: Profile) -> bool:
        """Whether ``chosen``'s profile waits for an encoded one (its plan moves anything)."""
        if chosen.may_encode and (plan is None or plan.moves):
            self.unencoded[chosen.signature] = (plan, profile)
            return True
        return False

    def take(self, signature: str) -> list[tuple[Plan, Profile]]:
        """The plan profiled without encoding, if one waits for ``signature``'s encoded profile."""
        plan, profile = self.unencoded.pop(signature, (None, None))
        return [(plan, profile)] if plan is not None and profile is not None else []
