"""torch's pipeline parallelism (`torch.distributed.pipelining`): a schedule's warm-up of its
stages' communicators, and whether a schedule re-initialises its stages.

- `LocalPeerStage`: a ``PipelineStage`` whose warm-up sends and receives
  (``_get_init_p2p_neighbors_ops``) leave out those to its own rank. Schedules that warm up
  with these ops (torch 2.11, 2.12; from 2.13 only a stage that is not a ``PipelineStage``
  does) send a dummy tensor to every neighbour's rank, and under zero_bubble's V-shape a
  rank holds two adjacent stages (pp=2: rank 1 holds stages 1 and 2): gloo has no
  connection of a rank to itself and fails ("Pair is not connected ... <--> [none]").
  Stages on one rank hand activations over in memory, so there is no communicator to warm
  up between them. Public replacement: torch leaving a stage's own rank out itself (2.13
  does, for its own stages).
- `switches_modes`: whether a schedule re-initialises its stages when it goes from
  evaluation to training (torch 2.13's do, in ``_initialize_pp_stages``; 2.11's do not).
  A probe: its absence is a supported state, so `missing` does not name it. Public
  replacement: none needed once the oldest supported torch re-initialises.
"""

from __future__ import annotations

from torch.distributed.pipelining import PipelineStage

from meshfit._compat import _probe


class LocalPeerStage(PipelineStage):
    """A ``PipelineStage`` that warms up no communicator from its rank to itself."""

    def _get_init_p2p_neighbors_ops(self):
        ops = super()._get_init_p2p_neighbors_ops()
        return [op for op in ops if getattr(op, "group_peer", None) != self.group_rank]


def switches_modes(schedule) -> bool:
    """Whether the torch schedule re-initialises its stages when it goes from eval to
    training (see the module docstring)."""
    return callable(getattr(schedule, "_initialize_pp_stages", None))


def missing() -> list[str]:
    return _probe.absent("torch", ("torch.distributed.pipelining.PipelineStage."
                                   "_get_init_p2p_neighbors_ops",))
