"""Overlap past the layer: two halves of the batch interleaved, each half's transfers under the
other half's compute (schedule.py), from collectives split into a post node and a wait node
whose backward mirrors the forward's schedule (split_phase.py), every collective node of a
forward linked to the one before it so that the backward runs them in one order on every rank
(chain.py). A client of the reading path, read after it."""
from .schedule import TransformerInHalves, block_in_halves, interleave
from .split_phase import post_all_gather_seq, post_reduce_scatter_seq

__all__ = ["TransformerInHalves", "block_in_halves", "interleave", "post_all_gather_seq",
           "post_reduce_scatter_seq"]
