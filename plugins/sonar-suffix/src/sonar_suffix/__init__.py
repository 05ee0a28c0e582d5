"""Suffix decoding for Sonar: the ``suffix`` method, on arctic-inference's suffix trees.

The plugin's hooks live in :mod:`sonar_suffix.plugin`, found through the ``sonar`` entry-point group;
the proposer in :mod:`sonar_suffix.proposer` and its options in :mod:`sonar_suffix.options`.
"""

__version__ = "0.1.0"
